// Exact causal multi-head self-attention with grouped-query heads (GQA), float32.
// Query head h reads key/value head h / (NH / NKV), as Hugging Face's repeat_kv arranges it;
// NKV == NH is plain multi-head attention, NKV == 1 multi-query attention.
// Scores are q·kᵀ / sqrt(HS); query t sees keys 0..t.
//
// Results are bitwise identical whatever the OpenMP thread count (every output element is
// produced by one thread in a fixed summation order) and whatever the instruction set (the
// baseline, AVX2 and AVX-512 paths do the same float operations in the same order).
#pragma once
#include <cstdint>

namespace moetrain {

// The shapes every attention implementation takes (this CPU one, the CUDA one): B, T ≥ 0,
// NH, NKV > 0 with NH % NKV == 0, HS > 0. An Error naming `fn` and the value otherwise.
void attention_check_args(const char* fn, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                          int64_t HS);

// out (B, T, NH, HS) = softmax(q·kᵀ / sqrt(HS) + causal mask) · v
// lse (B, NH, T) = log-sum-exp of each query row's scaled scores, kept for the backward pass.
// q (B, T, NH, HS); k, v (B, T, NKV, HS); NH % NKV == 0.
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS);

// Activation gradients, overwritten:
// dq (B, T, NH, HS); dk, dv (B, T, NKV, HS).
// dout, q, out (B, T, NH, HS); k, v (B, T, NKV, HS); lse (B, NH, T) from attention_forward.
// Probabilities are recomputed from q, k and lse rather than stored (flash-attention style), with
// D_t = sum(dout_t ⊙ out_t) standing in for the softmax Jacobian's row term.
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS);

// The same forward and backward with every matrix product on bf16 operands (q, k, v, dout, and
// the probabilities and score gradients, each rounded once) accumulated in f32: the attention
// core of the bf16 precision, on CPUs with AVX512_BF16 (kernels/attention_bf16.cpp). The
// softmax, lse, D and every sum outside the products stay f32. Results do not depend on the
// thread count; they differ from the f32 kernels' by the operands' rounding (2⁻⁹ of each).
// attention_bf16_supported: this CPU has AVX512_BF16, T and HS are even, T <= 512;
// attention_bf16_pays: supported, and T long enough that the products save more than packing
// their operands costs (T >= 128, measured): where the bf16 precision uses these kernels.
bool attention_bf16_supported(int64_t T, int64_t HS);
bool attention_bf16_pays(int64_t T, int64_t HS);
void attention_forward_bf16(float* out, float* lse, const float* q, const float* k,
                            const float* v, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                            int64_t HS);
void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const float* q,
                             const float* k, const float* v, const float* out, const float* lse,
                             int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS);

// One new query against a cache of n keys (a decode step): the causal row of attention_forward
// for a query at position n − 1. out, q (NH, HS); k, v (n, NKV, HS) with q and k already rotated.
// Reads exactly n keys per head: the work is n·HS multiply-adds per head, twice.
void attention_decode(float* out, const float* q, const float* k, const float* v, int64_t n,
                      int64_t NH, int64_t NKV, int64_t HS);

}  // namespace moetrain
