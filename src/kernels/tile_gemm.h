// The register-tiled f32 GEMM of the attention kernels (kernels/attention.cpp): scores, weighted
// sums and their gradients over blocks of a sequence, small enough that a oneDNN call would cost
// more than the product; and of the task products with a side under 16 (kernels/det_gemm.cpp: a
// router's E logits a token), which oneDNN runs at a fraction of its rate. Each output element is
// one sequential sum over k, whatever the tiling, the vector width or the thread, so every path
// gives the same bits.
#pragma once
#include <algorithm>
#include <cstdint>

namespace moetrain {

constexpr int64_t kTileRows = 4;   // C needs round_up(M, kTileRows) rows
constexpr int64_t kTileCols = 16;  // N is a multiple of this

// A causal product: row i of C needs only index i + offset and those below it, along its columns
// (a block of scores: query i0 + i sees keys up to i0 + i) or along the sum (probabilities times
// values: the terms past that index are zeros the caller wrote); or, along the sum, only index
// i + offset and those above it (a key's gradient sums over the queries at or after it, the
// terms before are zeros). A tile of rows then keeps to its rows' widest range: Columns leaves the
// column blocks wholly past its last row's limit unwritten (the caller reads none of them),
// TermsTo drops the terms past that limit and TermsFrom those before its first row's start
// (adding a zero product to a sum that is not −0, which none of these is, leaves its bits as
// they are, for finite operands).
struct TileCausal {
  enum Kind { None, Columns, TermsTo, TermsFrom } kind = None;
  int64_t offset = 0;

  // A tile of rows [i, i + rows): false where its column block at j lies wholly past its last
  // row's limit (Columns); else true, with the tile's sum range [k0, k1) narrowed (the Terms
  // kinds). tile_gemm's tiles and the bf16 attention's pair tiles both cut here.
  bool clip(int64_t i, int64_t rows, int64_t j, int64_t& k0, int64_t& k1) const {
    const int64_t limit = i + rows + offset;  // the last row's indices stop before this
    switch (kind) {
      case Columns:
        return j < limit;
      case TermsTo:
        k1 = std::max(k0, std::min(k1, limit));
        return true;
      case TermsFrom:
        k0 = std::min(k1, std::max(k0, i + offset));
        return true;
      case None:
        break;
    }
    return true;
  }
};

// C (M, N) = A (M, K) · B (K, N) [+ C], row-major with leading dimensions; trans_a: A is stored
// transposed, (K, M) with leading dimension lda. B is readable over all N columns. C needs
// round_up(M, kTileRows) rows: the last tile's surplus rows repeat A's last row and land in C's
// padding. The 16-float AVX-512 path where the CPU has it, else 8 floats.
void tile_gemm(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
               int64_t M, int64_t N, int64_t K, bool accumulate, bool trans_a = false,
               TileCausal causal = {});

// The same, the path chosen by the caller, for tests: wide takes the 16-float AVX-512 path where
// the CPU has it, else the 8-float one; both give the same bits.
void attention_tile_gemm(bool wide, float* C, int64_t ldc, const float* A, int64_t lda,
                         const float* B, int64_t ldb, int64_t M, int64_t N, int64_t K,
                         bool accumulate, bool trans_a = false, TileCausal causal = {});

}  // namespace moetrain
