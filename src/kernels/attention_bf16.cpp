// The attention core with bf16 products (kernels/attention.h, attention_forward_bf16): the
// f32 kernel's blocks, softmax and row work (kernels/attention_rows.h), with every product of
// two matrices taken on bf16 operands by AVX512_BF16's pair dot product (vdpbf16ps: two bf16
// products added to an f32 accumulator), twice the multiply-adds of an f32 FMA per instruction.
//
// Operands go in as pairs of bf16 along the reduction index, one 32-bit word a pair (the lower
// half the even index): a matrix read by rows (queries, dout, P and dS rows) is its bf16 copy
// as stored; one read by columns is packed "pair-major", (K/2, N) words, so that a 16-word load
// is 16 columns' pair. The backward forms each head's P and dS once, writes them both ways, and
// sums dq by rows and dk, dv by columns, as the f32 kernel's one pass does.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/bf16_round.h"
#include "core/check.h"
#include "core/dtype.h"
#include "core/profile.h"
#include "kernels/attention.h"
#include "kernels/attention_rows.h"
#include "kernels/tile_gemm.h"

namespace moetrain {

namespace {

constexpr int64_t kBlock = 32;  // queries (keys) a block, as in the f32 kernel
constexpr int64_t kCols = 16;   // a tile's columns: one vector of 16 f32
constexpr int64_t kRows = 8;    // a tile's rows: 8 independent accumulation chains
constexpr int64_t kMaxT = 512;  // longest padded sequence: a head's P and dS in a thread's buffers
constexpr int64_t kParallelMinWork = 1 << 20;
// Shortest sequence the bf16 products pay for their packs: at T = 64 (HS = 32) the forward and
// backward took as long as the f32 kernels', at T = 256 0.65–0.8 of it (bench_attention).
constexpr int64_t kBf16MinT = 128;

// Everything after the entry points' checks runs only on CPUs with AVX512_BF16
// (MOETRAIN_BF16_TARGET, core/bf16_round.h): compiled for them, the packs and row loops use
// 64-byte vectors. (The packs round with the scalar rule: vcvtneps2bf16 measured no faster
// there, where the stores, not the rounding, take the time.)

[[gnu::always_inline]] inline uint32_t pair(float lo, float hi) {
  return static_cast<uint32_t>(bf16::round_bits(lo)) | static_cast<uint32_t>(bf16::round_bits(hi))
                                                           << 16;
}

// (B, T, H, HS) f32 → the same layout in bf16: each row's HS values as HS/2 pairs.
uint32_t* row_pairs(int slot, const float* src, int64_t n) {
  uint32_t* dst = attention_scratch_as<uint32_t>(slot, n / 2);
  f32_to_bf16(reinterpret_cast<bf16*>(dst), src, static_cast<std::size_t>(n));
  return dst;
}

// dst (B, H, HS/2, Tp) = src (B, T, H, HS) paired along HS: word (x/2, t) holds src[t][x, x+1].
// Columns t ≥ T are zero.
MOETRAIN_BF16_TARGET void pairs_along_features(uint32_t* dst, const float* src, int64_t B,
                                               int64_t T, int64_t H, int64_t HS, int64_t Tp) {
  const int64_t HP = HS / 2;
#pragma omp parallel for collapse(2) schedule(static) if (B * T * H * HS >= kParallelMinCopy)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      uint32_t* d = dst + (b * H + h) * HP * Tp;
      for (int64_t t = 0; t < T; ++t) {
        const float* s = src + ((b * T + t) * H + h) * HS;
        for (int64_t x = 0; x < HP; ++x) d[x * Tp + t] = pair(s[2 * x], s[2 * x + 1]);
      }
      for (int64_t x = 0; x < HP; ++x) std::fill(d + x * Tp + T, d + (x + 1) * Tp, 0u);
    }
  }
}

// dst (B, H, Tp/2, HSp) = src (B, T, H, HS) paired along T: word (t/2, x) holds src[t, t+1][x].
// Columns x ≥ HS and rows t ≥ T are zero.
MOETRAIN_BF16_TARGET void pairs_along_sequence(uint32_t* dst, const float* src, int64_t B,
                                               int64_t T, int64_t H, int64_t HS, int64_t Tp,
                                               int64_t HSp) {
#pragma omp parallel for collapse(2) schedule(static) if (B * T * H * HS >= kParallelMinCopy)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      uint32_t* d = dst + (b * H + h) * (Tp / 2) * HSp;
      for (int64_t tp = 0; tp < Tp / 2; ++tp) {
        uint32_t* row = d + tp * HSp;
        const int64_t t = 2 * tp;
        if (t >= T) {
          std::fill(row, row + HSp, 0u);
          continue;
        }
        const float* s0 = src + ((b * T + t) * H + h) * HS;
        const float* s1 = s0 + H * HS;  // T is even: row t + 1 exists
        for (int64_t x = 0; x < HS; ++x) row[x] = pair(s0[x], s1[x]);
        std::fill(row + HS, row + HSp, 0u);
      }
    }
  }
}

// C (M, N) = Σ over kp < KP of A(r, kp) · B(kp, ·) [+ C], f32 from bf16 pairs: A(r, kp) is the
// word at A + r·sa_r + kp·sa_k, B(kp, n) the word at B + kp·ldb + n; N is a multiple of kCols.
// Each C element is one chain of pair products in kp order, whatever the tiling or the thread.
// causal as tile_gemm takes it (kernels/tile_gemm.h), its sum indices counted in values, not
// pairs: a tile's pairs are those holding any value its rows read.
MOETRAIN_BF16_TARGET void pair_gemm(float* C, int64_t ldc, const uint32_t* A, int64_t sa_r,
                                    int64_t sa_k, const uint32_t* B, int64_t ldb, int64_t M,
                                    int64_t N, int64_t KP, bool accumulate,
                                    TileCausal causal = {}) {
  for (int64_t j = 0; j < N; j += kCols) {
    for (int64_t i = 0; i < M; i += kRows) {
      const int64_t R = std::min(kRows, M - i);
      int64_t k0 = 0, k1 = 2 * KP;  // in values; the pairs holding any of them
      if (!causal.clip(i, R, j, k0, k1)) continue;
      const int64_t kp0 = k0 / 2, kp1 = (k1 + 1) / 2;
      const uint32_t* a[kRows];
      __m512 acc[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        a[r] = A + std::min(i + r, M - 1) * sa_r;  // rows past M repeat the last; not stored
        acc[r] = accumulate && r < R ? _mm512_loadu_ps(C + (i + r) * ldc + j) : _mm512_setzero_ps();
      }
      const uint32_t* b = B + kp0 * ldb + j;
      for (int64_t kp = kp0; kp < kp1; ++kp, b += ldb) {
        const __m512bh bv = (__m512bh)_mm512_loadu_si512(b);
        const int64_t ak = kp * sa_k;
#pragma GCC unroll 8
        for (int64_t r = 0; r < kRows; ++r)
          acc[r] =
              _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r][ak])), bv);
      }
      for (int64_t r = 0; r < R; ++r) _mm512_storeu_ps(C + (i + r) * ldc + j, acc[r]);
    }
  }
}

// A row's first n (even) values as n/2 pairs: the row in bf16, as stored.
MOETRAIN_BF16_TARGET void row_to_pairs(uint32_t* dst, const float* row, int64_t n) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t j = 0; j < n; ++j) d[j] = bf16::round_bits(row[j]);
}

// Rows i and i + 1 (i even) of a head's (T, T) matrix, their first n values, into word row i/2
// of the pair-major (Tp/2, Tp) words: word (i/2, j) = (row i, row i + 1) at column j.
MOETRAIN_BF16_TARGET void rows_into_columns(uint32_t* dst, const float* row0, const float* row1,
                                            int64_t i, int64_t n, int64_t Tp) {
  uint32_t* d = dst + (i / 2) * Tp;
  for (int64_t j = 0; j < n; ++j) d[j] = pair(row0[j], row1[j]);
}

// attention_forward_bf16 after its checks.
MOETRAIN_BF16_TARGET void forward_blocks(float* out, float* lse, const float* q, const float* k,
                                         const float* v, int64_t B, int64_t T, int64_t NH,
                                         int64_t NKV, int64_t HS) {
  const int64_t G = NH / NKV, Tp = round_up(T, kBlock), HSp = round_up(HS, kCols), HP = HS / 2;
  const int64_t nqb = Tp / kBlock;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));

  const uint32_t* qr = row_pairs(0, q, B * T * NH * HS);
  uint32_t* kx = attention_scratch_as<uint32_t>(1, B * NKV * HP * Tp);
  uint32_t* vt = attention_scratch_as<uint32_t>(2, B * NKV * (Tp / 2) * HSp);
  pairs_along_features(kx, k, B, T, NKV, HS, Tp);
  pairs_along_sequence(vt, v, B, T, NKV, HS, Tp, HSp);

  const int64_t tasks = B * NH * nqb;
#pragma omp parallel if (B * NH * T * T * HS >= kParallelMinWork)
  {
    float* s = attention_scratch_as<float>(8, kBlock * Tp);
    uint32_t* pr = attention_scratch_as<uint32_t>(9, kBlock * Tp / 2);
    float* o = attention_scratch_as<float>(10, kBlock * HSp);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t qb = nqb - 1 - task % nqb, b = task / nqb / NH, h = task / nqb % NH, g = h / G;
      const int64_t i0 = qb * kBlock, M = std::min(kBlock, T - i0), nk = i0 + M;
      const int64_t qrow = (b * T + i0) * NH + h;
      pair_gemm(s, Tp, qr + qrow * HP, NH * HP, 1, kx + (b * NKV + g) * HP * Tp, Tp, M,
                round_up(nk, kCols), HP, false, {TileCausal::Columns, i0});
      float inv_l[kBlock];
      RowSoftmax sm[kBlock];
      softmax_rows(sm, s, Tp, M, i0 + 1, nk, scale);  // query i0 + r sees i0 + r + 1 keys
      for (int64_t r = 0; r < M; ++r) row_to_pairs(pr + r * (Tp / 2), s + r * Tp, nk);
      block_lse(lse + (b * NH + h) * T + i0, inv_l, sm, M);
      pair_gemm(o, HSp, pr, Tp / 2, 1, vt + (b * NKV + g) * (Tp / 2) * HSp, HSp, M, HSp, nk / 2,
                false, {TileCausal::TermsTo, i0});
      for (int64_t r = 0; r < M; ++r) {
        float* dst = out + (qrow + r * NH) * HS;
        for (int64_t x = 0; x < HS; ++x) dst[x] = o[r * HSp + x] * inv_l[r];
      }
    }
  }
}

// attention_backward_bf16 after its checks.
MOETRAIN_BF16_TARGET void backward_heads(float* dq, float* dk, float* dv, const float* dout,
                                         const float* q, const float* k, const float* v,
                                         const float* out, const float* lse, int64_t B, int64_t T,
                                         int64_t NH, int64_t NKV, int64_t HS) {
  const int64_t G = NH / NKV, Tp = round_up(T, kBlock), HSp = round_up(HS, kCols), HP = HS / 2;
  const int64_t nb = Tp / kBlock, TP2 = Tp / 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));

  float* D = attention_scratch_as<float>(0, B * NH * T);
  attention_row_terms(D, dout, out, B, T, NH, HS);
  const uint32_t* qr = row_pairs(1, q, B * T * NH * HS);
  const uint32_t* dor = row_pairs(2, dout, B * T * NH * HS);
  uint32_t* kx = attention_scratch_as<uint32_t>(3, B * NKV * HP * Tp);    // scores: q · kᵀ
  uint32_t* vx = attention_scratch_as<uint32_t>(4, B * NKV * HP * Tp);    // dP = dout · vᵀ
  uint32_t* kt = attention_scratch_as<uint32_t>(5, B * NKV * TP2 * HSp);  // dq = dS · k
  uint32_t* qt = attention_scratch_as<uint32_t>(6, B * NH * TP2 * HSp);   // dk = dSᵀ · q
  uint32_t* dot = attention_scratch_as<uint32_t>(7, B * NH * TP2 * HSp);  // dv = Pᵀ · dout
  pairs_along_features(kx, k, B, T, NKV, HS, Tp);
  pairs_along_features(vx, v, B, T, NKV, HS, Tp);
  pairs_along_sequence(kt, k, B, T, NKV, HS, Tp, HSp);
  pairs_along_sequence(qt, q, B, T, NH, HS, Tp, HSp);
  pairs_along_sequence(dot, dout, B, T, NH, HS, Tp, HSp);

  const int64_t tasks = B * NKV;
#pragma omp parallel if (B * NH * T * T * HS >= kParallelMinWork)
  {
    float* pm = attention_scratch_as<float>(8, kBlock * Tp);           // a block's S, then P
    float* dsm = attention_scratch_as<float>(9, kBlock * Tp);          // its dP, then dS
    uint32_t* dsr = attention_scratch_as<uint32_t>(10, kBlock * TP2);  // dS rows as pairs
    uint32_t* pc = attention_scratch_as<uint32_t>(11, TP2 * Tp);       // the head's P, pair-major
    uint32_t* dsc = attention_scratch_as<uint32_t>(12, TP2 * Tp);      // the head's dS, pair-major
    float* acc = attention_scratch_as<float>(13, kBlock * HSp);
    float* dk_acc = attention_scratch_as<float>(14, Tp * HSp);
    float* dv_acc = attention_scratch_as<float>(15, Tp * HSp);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / NKV, g = task % NKV;
      std::fill(dk_acc, dk_acc + Tp * HSp, 0.0f);
      std::fill(dv_acc, dv_acc + Tp * HSp, 0.0f);
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        for (int64_t qb = 0; qb < nb; ++qb) {
          const int64_t i0 = qb * kBlock, M = std::min(kBlock, T - i0), nk = i0 + M,
                        N = round_up(nk, kCols);
          const int64_t qrow = (b * T + i0) * NH + h;
          pair_gemm(pm, Tp, qr + qrow * HP, NH * HP, 1, kx + (b * NKV + g) * HP * Tp, Tp, M, N, HP,
                    false, {TileCausal::Columns, i0});
          pair_gemm(dsm, Tp, dor + qrow * HP, NH * HP, 1, vx + (b * NKV + g) * HP * Tp, Tp, M, N,
                    HP, false, {TileCausal::Columns, i0});
          for (int64_t r = 0; r < M; ++r) {
            const int64_t i = i0 + r;
            float* p = pm + r * Tp;
            float* ds = dsm + r * Tp;
            p_ds_row(p, ds, i + 1, scale, lse[(b * NH + h) * T + i], D[(b * NH + h) * T + i]);
            std::fill(p + i + 1, p + nk, 0.0f);
            std::fill(ds + i + 1, ds + nk, 0.0f);
            row_to_pairs(dsr + r * TP2, ds, nk);
            if (r % 2 == 1) {  // M is even: rows pair up within the block
              rows_into_columns(pc, p - Tp, p, i - 1, nk, Tp);
              rows_into_columns(dsc, ds - Tp, ds, i - 1, nk, Tp);
            }
          }
          pair_gemm(acc, HSp, dsr, TP2, 1, kt + (b * NKV + g) * TP2 * HSp, HSp, M, HSp, nk / 2,
                    false, {TileCausal::TermsTo, i0});
          for (int64_t r = 0; r < M; ++r) {
            float* dst = dq + (qrow + r * NH) * HS;
            for (int64_t x = 0; x < HS; ++x) dst[x] = acc[r * HSp + x] * scale;
          }
        }
        // Key block j0 sums over the queries at or after it: pairs of query rows from j0/2 on
        // (each written up to its block's last key, past every key of this block).
        for (int64_t j0 = 0; j0 < T; j0 += kBlock) {
          const int64_t M = std::min(kBlock, T - j0), KP = (T - j0) / 2;
          const uint32_t* dob = dot + ((b * NH + h) * TP2 + j0 / 2) * HSp;
          const uint32_t* qb = qt + ((b * NH + h) * TP2 + j0 / 2) * HSp;
          pair_gemm(dv_acc + j0 * HSp, HSp, pc + (j0 / 2) * Tp + j0, 1, Tp, dob, HSp, M, HSp, KP,
                    true, {TileCausal::TermsFrom, 0});
          pair_gemm(dk_acc + j0 * HSp, HSp, dsc + (j0 / 2) * Tp + j0, 1, Tp, qb, HSp, M, HSp, KP,
                    true, {TileCausal::TermsFrom, 0});
        }
      }
      write_kv_gradients(dk, dv, dk_acc, dv_acc, b, g, T, NKV, HS, HSp, scale);
    }
  }
}

}  // namespace

bool attention_bf16_supported(int64_t T, int64_t HS) {
  const bool cpu = cpu_has_avx512_bf16();
  return cpu && T % 2 == 0 && HS % 2 == 0 && round_up(T, kBlock) <= kMaxT;
}

bool attention_bf16_pays(int64_t T, int64_t HS) {
  return attention_bf16_supported(T, HS) && T >= kBf16MinT;
}

void attention_forward_bf16(float* out, float* lse, const float* q, const float* k, const float* v,
                            int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  PhaseScope phase_scope(Phase::Attention);
  attention_check_args("attention_forward_bf16", B, T, NH, NKV, HS);
  if (B == 0 || T == 0) return;
  MOETRAIN_CHECK(attention_bf16_supported(T, HS),
                 "attention_forward_bf16: T={} HS={}: needs AVX512_BF16, even T and HS, T <= {}", T,
                 HS, kMaxT);
  MOETRAIN_CHECK(out && lse && q && k && v, "attention_forward_bf16: null buffer for B={} T={}", B,
                 T);
  forward_blocks(out, lse, q, k, v, B, T, NH, NKV, HS);
}

void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const float* q,
                             const float* k, const float* v, const float* out, const float* lse,
                             int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  PhaseScope phase_scope(Phase::Attention);
  attention_check_args("attention_backward_bf16", B, T, NH, NKV, HS);
  if (B == 0 || T == 0) return;
  MOETRAIN_CHECK(attention_bf16_supported(T, HS),
                 "attention_backward_bf16: T={} HS={}: needs AVX512_BF16, even T and HS, T <= {}",
                 T, HS, kMaxT);
  MOETRAIN_CHECK(dq && dk && dv && dout && q && k && v && out && lse,
                 "attention_backward_bf16: null buffer for B={} T={}", B, T);
  backward_heads(dq, dk, dv, dout, q, k, v, out, lse, B, T, NH, NKV, HS);
}

}  // namespace moetrain
