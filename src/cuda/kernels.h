// The device kernels of the train step, one family per file of src/cuda, each `<op>_forward`
// right above its `<op>_backward`, with the shapes and accumulation rules of the CPU kernel of the
// same name (src/kernels, src/moe/dispatch.h): parameter gradients +=, activation gradients =.
// Every pointer is device memory; every call is asynchronous on `s`; a bad shape throws from the
// host launcher before anything is queued. Device code cannot throw: an id or target out of range
// gives a NaN row (forward) or is skipped (backward) instead of an out-of-bounds access; the
// model checks the tokens on the host first. No kernel uses floating-point atomics: each output
// element is summed by one thread (or one warp) in a fixed order, so a run is bitwise repeatable
// on one GPU (bit-exact resume); against the CPU, kernels agree bitwise where they perform the
// same uncontracted operations (embedding, add, permute/combine, AdamW) and otherwise within the
// error bounds their tests state.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "optim/adamw_scalars.h"

namespace moetrain::cuda {

class Context;  // cuda/device.h: the stream, cuBLAS handle and GEMM mode of the device operations

// --- embedding.cu ---
// out (N, C) = table[ids];  ids (N) in [0, V);  table (V, C).
void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                       int64_t V, cudaStream_t s);
// dtable (V, C) += rows of dout (N, C) by ids, each id's rows summed in token order.
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C,
                        int64_t V, cudaStream_t s);

// --- norm.cu ---
// out (N, C) = weight ⊙ (inp · rstd);  rstd (N) = 1 / sqrt(mean(inp²) + eps). out may alias inp.
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps, cudaStream_t s);
// dinp (N, C) = ∂/∂inp;  dweight (C) += Σ_rows dout·inp·rstd (each column's rows in
// kernels/norm.cpp's chunks of 256 rows, in order).
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C, cudaStream_t s);

// --- rope.cu ---
// out (N, NH, HS) = rope(inp) at positions pos (N), rotating the pairs (i, i + HS/2) as
// kernels/rope.h does (inv_freq in f32 as transformers computes it). out may alias inp.
// HS ≤ 1024.
void rope_forward(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                  int64_t HS, float theta, cudaStream_t s);
// dinp = the inverse rotation of dout. dinp may alias dout.
void rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t N, int64_t NH,
                   int64_t HS, float theta, cudaStream_t s);

// --- attention.cu ---
// Causal grouped-query attention. out (B, T, NH, HS) = softmax(q·kᵀ/√HS + mask)·v;
// lse (B, NH, T); q (B, T, NH, HS); k, v (B, T, NKV, HS); NH % NKV == 0; HS ≤ 256. Outputs
// must not alias inputs. On the context's stream; with the context's TF32 or bf16 GEMM mode (and
// not attention_f32) the products run on the tensor cores (operands rounded to TF32 or bf16,
// scores and sums f32), using the context's workspace.
void attention_forward(const Context& ctx, float* out, float* lse, const float* q, const float* k,
                       const float* v, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS);
// dq (B, T, NH, HS) =, dk, dv (B, T, NKV, HS) = ; probabilities recomputed from q, k and lse.
// The f32 path allocates B·NH·T floats of scratch on the stream (cudaMallocAsync) for the rows'
// D = Σ dout·out.
void attention_backward(const Context& ctx, float* dq, float* dk, float* dv, const float* dout,
                        const float* q, const float* k, const float* v, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                        int64_t HS);

// --- activation.cu ---
// out (n) = silu(a) ⊙ b
// With out16, also bf16(out) there.
void swiglu_forward(float* out, const float* a, const float* b, int64_t n, cudaStream_t s,
                    uint16_t* out16 = nullptr);
// da = dout ⊙ b ⊙ silu'(a);  db = dout ⊙ silu(a)
// With da16 and db16, bf16(da) and bf16(db) there instead of da and db (which are not written).
void swiglu_backward(float* da, float* db, const float* dout, const float* a, const float* b,
                     int64_t n, cudaStream_t s, uint16_t* da16 = nullptr, uint16_t* db16 = nullptr);
// out (n) = a + b (out may alias a or b)
void add(float* out, const float* a, const float* b, int64_t n, cudaStream_t s);

// --- softmax.cu ---
// losses (N) = lse − logits[target] (0 where target = −1);  lse (N);  logits (N, V).
void softmax_xent_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                          int64_t N, int64_t V, cudaStream_t s);
// dlogits (N, V) = dlosses · (softmax(logits) − onehot(target)), 0 on rows with target −1.
// dlogits may alias logits.
void softmax_xent_backward(float* dlogits, const float* dlosses, const float* logits,
                           const float* lse, const int32_t* targets, int64_t N, int64_t V,
                           cudaStream_t s);

// --- dispatch.cu --- (the layout arrays of moe/dispatch.h's DispatchLayout, copied to the device)
// xp (R, C): row r = inp[row_token[r]].  inp (N, C)
void permute_forward(float* xp, const float* inp, const int32_t* row_token, int64_t R, int64_t C,
                     cudaStream_t s);
// dinp (N, C) [+]= Σ over the token's slots s (in slot order) with slot_row ≥ 0 of dxp[row].
// slot_row (N, S)
void permute_backward(float* dinp, const float* dxp, const int32_t* slot_row, int64_t N, int64_t S,
                      int64_t C, bool accumulate, cudaStream_t s);
// out (N, C) [+]= Σ over the token's slots, in slot order, of row_weight[row] · y[row]; a token
// with no rows gets 0 (or keeps out when accumulating). y (R, C), row_weight (R)
void combine_forward(float* out, const float* y, const int32_t* slot_row, const float* row_weight,
                     int64_t N, int64_t S, int64_t C, bool accumulate, cudaStream_t s);
// dy (R, C) = row_weight[row] · dout[token];  dweight (N, S) = dout[token] · y[row], 0 on slots
// with slot_row −1. Rows are reached through slot_row: every row belongs to exactly one slot, as
// build_layout makes them.
void combine_backward(float* dy, float* dweight, const float* dout, const float* y,
                      const int32_t* slot_row, const float* row_weight, int64_t N, int64_t S,
                      int64_t C, cudaStream_t s);

// --- adamw.cu ---
// One fused AdamW pass over n elements with exactly the float operations of optim/adamw.cpp
// (torch.optim.AdamW), from the scalars adamw_scalars() computes for the step:
//   p ← p·decay (decay groups only);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·(g·g);
//   p ← p − step_size·(m / (√v / bias2_sqrt + eps))
// No operation is contracted into an FMA, so the result is bitwise the CPU's.
// With params_bf16 (n, may be null) the same pass writes the new parameters' bf16 copy (the
// operands of train.precision = bf16), rounded as to_bf16 rounds.
void adamw_step(float* params, float* exp_avg, float* exp_avg_sq, const float* grads, int64_t n,
                bool decay, const AdamWScalars& a, cudaStream_t s, uint16_t* params_bf16 = nullptr);

// --- convert.cu ---
// out (n) = in rounded to bf16, bit for bit core/dtype.h's bf16(float) (the CPU's operands).
void to_bf16(uint16_t* out, const float* in, int64_t n, cudaStream_t s);

// --- grad.cu --- (the device gradient of the update step, optim/update.h)
// Σ g² in double and the count of NaN/Inf over g (n): fixed blocks of 2^16 elements, each summed in
// a fixed order, their partials summed on the host in block order (synchronises the stream).
struct GradSums {
  double sum_squares = 0;
  uint64_t non_finite = 0;
};
GradSums grad_sums(const float* g, int64_t n, cudaStream_t s);
// g (n) *= factor.
void scale(float* g, int64_t n, float factor, cudaStream_t s);

}  // namespace moetrain::cuda
