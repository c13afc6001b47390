#include "kernels/tile_gemm.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "core/cpu.h"

namespace moetrain {

namespace {

constexpr int64_t kMR = kTileRows;
constexpr int64_t kNR = kTileCols;
constexpr int64_t kKC = 128;  // reduction chunk: a (kKC, kNR) panel of B is 8 KiB (16 KiB two wide)

// The build targets baseline x86-64; the AVX2 clone is picked at load time where the CPU has it.
// Both clones do the same float operations in the same order ("avx2" does not enable FMA, so
// nothing gets contracted), so they agree bitwise.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOETRAIN_TILE_HOT __attribute__((target_clones("avx2", "default")))
#else
#define MOETRAIN_TILE_HOT
#endif

typedef float V8 __attribute__((vector_size(32)));

// One tile of C: rows [i, i + R) (those past M repeat A's last row and land in C's padding) by
// columns [j, j + kV · lanes), summed over k in [k0, k1), with kV vectors of VF per tile row.
// kTA: A is stored transposed, (K, M) with leading dimension lda.
template <class VF, int64_t R, int64_t kV, bool kTA>
[[gnu::always_inline]] inline void block_tile(float* __restrict C, int64_t ldc,
                                              const float* __restrict A, int64_t lda,
                                              const float* __restrict B, int64_t ldb, int64_t M,
                                              int64_t i, int64_t j, int64_t k0, int64_t k1,
                                              bool load_c) {
  constexpr int64_t kLanes = sizeof(VF) / sizeof(float);
  const float* a[R];
  for (int64_t r = 0; r < R; ++r) a[r] = A + std::min(i + r, M - 1) * (kTA ? 1 : lda);
  const int64_t a_step = kTA ? lda : 1;
  VF acc[R][kV];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t v = 0; v < kV; ++v) {
      if (load_c)
        std::memcpy(&acc[r][v], C + (i + r) * ldc + j + v * kLanes, sizeof(VF));
      else
        acc[r][v] = VF{};
    }
  }
  const float* b = B + k0 * ldb + j;
  for (int64_t kk = k0; kk < k1; ++kk, b += ldb) {
    VF bv[kV];
    for (int64_t v = 0; v < kV; ++v) std::memcpy(&bv[v], b + v * kLanes, sizeof(VF));
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      const float ar = a[r][kk * a_step];
      for (int64_t v = 0; v < kV; ++v) acc[r][v] += ar * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t v = 0; v < kV; ++v)
      std::memcpy(C + (i + r) * ldc + j + v * kLanes, &acc[r][v], sizeof(VF));
  }
}

// One tile of rows [i, i + R) over columns [j, j + kV · lanes), as `causal` clips it: none where
// its columns lie wholly past its rows' limit, the first column block alone where only the second
// of two does (a causal block's diagonal: half the tile's products go unformed).
template <class VF, int64_t R, int64_t kV, bool kTA>
[[gnu::always_inline]] inline void clipped_tile(float* __restrict C, int64_t ldc,
                                                const float* __restrict A, int64_t lda,
                                                const float* __restrict B, int64_t ldb, int64_t M,
                                                int64_t i, int64_t j, int64_t k0, int64_t k1,
                                                bool load_c, const TileCausal& causal) {
  constexpr int64_t kVb = kNR / static_cast<int64_t>(sizeof(VF) / sizeof(float));  // a block's
  int64_t ka = k0, kb = k1;
  if (!causal.clip(i, R, j, ka, kb)) return;
  if constexpr (kV == 2 * kVb) {
    int64_t ka2 = ka, kb2 = kb;
    if (!causal.clip(i, R, j + kNR, ka2, kb2))
      return block_tile<VF, R, kVb, kTA>(C, ldc, A, lda, B, ldb, M, i, j, ka, kb, load_c);
  }
  block_tile<VF, R, kV, kTA>(C, ldc, A, lda, B, ldb, M, i, j, ka, kb, load_c);
}

// The row tiles of columns [j, j + kV · lanes): R rows while R remain, then kMR.
template <class VF, int64_t R, int64_t kV, bool kTA>
[[gnu::always_inline]] inline void column_tiles(float* __restrict C, int64_t ldc,
                                                const float* __restrict A, int64_t lda,
                                                const float* __restrict B, int64_t ldb, int64_t M,
                                                int64_t j, int64_t k0, int64_t k1, bool load_c,
                                                const TileCausal& causal) {
  static_assert(R % kMR == 0);
  int64_t i = 0;
  if constexpr (R > kMR) {
    for (; i + R <= M; i += R)
      clipped_tile<VF, R, kV, kTA>(C, ldc, A, lda, B, ldb, M, i, j, k0, k1, load_c, causal);
  }
  for (; i < M; i += kMR)
    clipped_tile<VF, kMR, kV, kTA>(C, ldc, A, lda, B, ldb, M, i, j, k0, k1, load_c, causal);
}

// C (M, N) = A (M, K) · B (K, N)  [+ C], row-major with leading dimensions.
// N is a multiple of kNR and B is readable over all N columns. C needs round_up(M, kMR) rows: the
// last tile's surplus rows repeat A's last row and land in C's padding. Each C element is one
// sequential sum over k (C is stored and reloaded between k chunks, which rounds nothing), so the
// result does not depend on tiling or threads.
// Loop order keeps a (kKC, kNR · kW) panel of B in L1 while every row tile of the block passes
// over it. A tile is R rows by kW · kNR columns (kW = 2 where two column blocks remain, else 1):
// its R · kW · kNR / lanes accumulators are the independent addition chains that hide the adds'
// latency, and each broadcast element of A serves kW · kNR / lanes of them.
template <class VF, int64_t R, int64_t kW, bool kTA>
[[gnu::always_inline]] inline void block_gemm_impl(float* __restrict C, int64_t ldc,
                                                   const float* __restrict A, int64_t lda,
                                                   const float* __restrict B, int64_t ldb,
                                                   int64_t M, int64_t N, int64_t K,
                                                   bool accumulate, const TileCausal& causal) {
  constexpr int64_t kV = kNR / (sizeof(VF) / sizeof(float));
  for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += kKC) {
    const int64_t k1 = std::min(K, k0 + kKC);
    const bool load_c = accumulate || k0 > 0;
    int64_t j = 0;
    if constexpr (kW > 1) {
      for (; j + kW * kNR <= N; j += kW * kNR)
        column_tiles<VF, R, kW * kV, kTA>(C, ldc, A, lda, B, ldb, M, j, k0, k1, load_c, causal);
    }
    for (; j < N; j += kNR)
      column_tiles<VF, R, kV, kTA>(C, ldc, A, lda, B, ldb, M, j, k0, k1, load_c, causal);
  }
}

// trans_a: A is stored transposed, (K, M) with leading dimension lda (C = Aᵀ·B).
MOETRAIN_TILE_HOT void block_gemm_v8(float* __restrict C, int64_t ldc, const float* __restrict A,
                                     int64_t lda, const float* __restrict B, int64_t ldb,
                                     int64_t M, int64_t N, int64_t K, bool accumulate,
                                     bool trans_a, const TileCausal& causal) {
  if (trans_a)
    return block_gemm_impl<V8, kMR, 1, true>(C, ldc, A, lda, B, ldb, M, N, K, accumulate, causal);
  block_gemm_impl<V8, kMR, 1, false>(C, ldc, A, lda, B, ldb, M, N, K, accumulate, causal);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOETRAIN_TILE_WIDE 1
// Where the CPU has AVX-512, a tile is 8 rows of 16-float vectors (half the instructions of
// 8-float ones), two vectors a row where two column blocks remain: 16 accumulators, each element
// of A broadcast once for two vectors of B (0.82 of the one-vector tile's attention time at
// T = 1024, 0.92-0.95 at T = 64-256 on a Zen 5). Every C element is still the same sequential
// sum, so the bits are the same.
constexpr int64_t kWide = 2;  // column blocks of kNR a tile spans on this path
__attribute__((target("avx512f"))) void block_gemm_v16(float* __restrict C, int64_t ldc,
                                                       const float* __restrict A, int64_t lda,
                                                       const float* __restrict B, int64_t ldb,
                                                       int64_t M, int64_t N, int64_t K,
                                                       bool accumulate, bool trans_a,
                                                       const TileCausal& causal) {
  typedef float V16 __attribute__((vector_size(64)));
  if (trans_a)
    return block_gemm_impl<V16, 2 * kMR, kWide, true>(C, ldc, A, lda, B, ldb, M, N, K, accumulate,
                                                      causal);
  block_gemm_impl<V16, 2 * kMR, kWide, false>(C, ldc, A, lda, B, ldb, M, N, K, accumulate, causal);
}
#endif

}  // namespace

void tile_gemm(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
               int64_t M, int64_t N, int64_t K, bool accumulate, bool trans_a, TileCausal causal) {
#ifdef MOETRAIN_TILE_WIDE
  if (cpu_has_avx512f())
    return block_gemm_v16(C, ldc, A, lda, B, ldb, M, N, K, accumulate, trans_a, causal);
#endif
  block_gemm_v8(C, ldc, A, lda, B, ldb, M, N, K, accumulate, trans_a, causal);
}

void attention_tile_gemm(bool wide, float* C, int64_t ldc, const float* A, int64_t lda,
                         const float* B, int64_t ldb, int64_t M, int64_t N, int64_t K,
                         bool accumulate, bool trans_a, TileCausal causal) {
  MOETRAIN_CHECK(M > 0 && N > 0 && N % kTileCols == 0 && K >= 0,
                 "attention_tile_gemm: M={} N={} K={}: need M > 0, N a positive multiple of {}", M,
                 N, K, kTileCols);
#ifdef MOETRAIN_TILE_WIDE
  if (wide && cpu_has_avx512f())
    return block_gemm_v16(C, ldc, A, lda, B, ldb, M, N, K, accumulate, trans_a, causal);
#endif
  block_gemm_v8(C, ldc, A, lda, B, ldb, M, N, K, accumulate, trans_a, causal);
}

}  // namespace moetrain
