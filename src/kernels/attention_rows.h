// The work both attention implementations on the CPU share (kernels/attention.cpp in f32,
// kernels/attention_bf16.cpp with bf16 products), in kernels/attention_rows.cpp: their
// thread-kept scratch, the f32 kernel's head transposes (kernels/attention_pack.cpp), the causal
// softmax of a block's rows of scores, the backward's probabilities and score gradients of a row,
// the backward's row terms D, and the one-pass backward's write of a task's key and value
// gradients.
#pragma once
#include <cstdint>

namespace moetrain {

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// n 4-byte elements (f32 or bf16 pairs) in buffer `slot` (0 to 15) of the calling thread, which
// keeps it: an allocation of a pack's size comes from the kernel, which zero-fills every page of
// it again at each call. Contents unspecified: fully written before they are read. A call's packs
// take the low slots, the work buffers of its parallel region's threads (the calling thread among
// them) slots above every pack's.
void* attention_scratch(int slot, int64_t n);
template <class T>
T* attention_scratch_as(int slot, int64_t n) {
  static_assert(sizeof(T) == 4);
  return static_cast<T*>(attention_scratch(slot, n));
}

// Copies below this many floats run on one thread: a parallel region would cost more.
constexpr int64_t kParallelMinCopy = 1 << 16;

// dst (B, H, HS, Tp) = src (B, T, H, HS) with each head's (T, HS) matrix transposed; columns t >= T
// are zero. Scores then come out of the f32 kernel's tile_gemm as rows of contiguous keys (or
// queries). kernels/attention_pack.cpp.
void pack_transposed(float* dst, const float* src, int64_t B, int64_t T, int64_t H, int64_t HS,
                     int64_t Tp);

struct RowSoftmax {
  float m;   // the row's largest scaled score
  double l;  // sum of exp(score - m)
};

// The causal softmax of a block of M rows of scores, row r at s + r · ld seeing n0 + r columns:
// row[0, n) *= scale, then exp(row[j] - m) in place, zeros on [n, nk), the row's maximum and sum
// in sm[r]. Each row's bits are its own: the same whichever block or position it is taken in.
// Rows must be readable and writable over round_up(max(n0 + M - 1, nk), 16) columns.
void softmax_rows(RowSoftmax* sm, float* s, int64_t ld, int64_t M, int64_t n0, int64_t nk,
                  float scale);

// A block of forward rows' results from their softmaxes, r in [0, M): lse[r] = sm[r].m +
// log(sm[r].l) and inv_l[r] = 1 / sm[r].l, each rounded to float; the log through log_vd4
// (kernels/vec_math.h), four rows at a time.
void block_lse(float* lse, float* inv_l, const RowSoftmax* sm, int64_t M);

// p[j] = exp(s[j]·scale − L), ds[j] = p[j] · (dp[j] − D) for j in [0, n): p in place of s, ds in
// place of dp. Both rows are written over round_up(n, 8) columns; what lands past n is the
// caller's to overwrite.
void p_ds_row(float* s, float* dp, int64_t n, float scale, float L, float D);

// p[c] = exp(p[c]·scale − L[c]), ds[c] = p[c] · (ds[c] − D[c]) for c in [0, n): a key's row of the
// two-pass backward, one query a column; the operations of p_ds_row, so the same bits. L and D are
// read over n only; p and ds are written over n only.
void p_ds_cols(float* p, float* ds, const float* L, const float* D, int64_t n, float scale);

// softmax_rows and p_ds_row, the path chosen by the caller, for tests: wide takes the 16-lane
// AVX-512 path where the CPU has it, else the 8-lane one; both give the same bits.
void attention_softmax_rows(bool wide, RowSoftmax* sm, float* s, int64_t ld, int64_t M,
                            int64_t n0, int64_t nk, float scale);
void attention_p_ds_row(bool wide, float* s, float* dp, int64_t n, float scale, float L, float D);

// D (B, NH, T) = Σ over the head's HS values of dout ⊙ out (B, T, NH, HS): the softmax Jacobian's
// row term, which equals Σ dP·P over the row.
void attention_row_terms(float* D, const float* dout, const float* out, int64_t B, int64_t T,
                         int64_t NH, int64_t HS);

// One (batch b, kv head g) task's summed key and value gradients, (Tp, HSp) accumulators, into
// dk, dv (B, T, NKV, HS): dk scaled by `scale` (the scores' 1/√HS), dv as summed.
void write_kv_gradients(float* dk, float* dv, const float* dk_acc, const float* dv_acc, int64_t b,
                        int64_t g, int64_t T, int64_t NKV, int64_t HS, int64_t HSp, float scale);

}  // namespace moetrain
