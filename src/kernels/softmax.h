// Row softmax and the fused softmax + cross-entropy used by the language-model head.
#pragma once
#include <cstdint>

namespace moetrain {

// out (N, V) = softmax(inp) along each row, max-subtracted so large logits stay finite.
// out may alias inp.
void softmax_forward(float* out, const float* inp, int64_t N, int64_t V);
// dinp (N, V) = out ⊙ (dout − Σ_v dout ⊙ out);  dout, out (N, V), out from softmax_forward.
// dinp may alias dout.
void softmax_backward(float* dinp, const float* dout, const float* out, int64_t N, int64_t V);

// Cross-entropy of softmax(logits) against targets, without materialising the probabilities.
// losses (N) = lse − logits[target];  lse (N) = log Σ_v exp(logits) (saved for backward);
// logits (N, V);  targets (N) in [0, V), or −1 to ignore a row (loss 0).
void softmax_xent_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                          int64_t N, int64_t V);
// dlogits (N, V) = dlosses[i] · (softmax(logits_i) − onehot(target_i)); rows with target −1 get 0.
// dlosses, lse, targets (N);  logits (N, V). dlogits may alias logits (in-place backward).
// lse is a float, so probabilities carry its rounding: relative error ≈ ulp(lse) / 2 (1e-6 for
// logits of magnitude 10, 5e-4 at 1e4).
void softmax_xent_backward(float* dlogits, const float* dlosses, const float* logits,
                           const float* lse, const int32_t* targets, int64_t N, int64_t V);

// The same cross-entropy over a vocabulary split into shards (tensor parallelism: each process
// holds logits (N, V) of the columns [v0, v0 + V) of a vocabulary of V_total), in passes around
// two all-reductions over the shards that the caller makes, so that no process holds whole rows:
//   1. xent_shard_max:   row_max (N) = max over the shard's columns; the caller takes the max
//                        over shards.
//   2. xent_shard_sums:  sums (2N) = for each row Σ_v exp(x_v − row_max) and x[target] when the
//                        target is in the shard (else 0), in double; the caller sums over shards.
//   3. xent_shard_finish: lse (N) = row_max + log Σ; losses (N) = lse − x[target] (0 for target −1).
// targets (N) in [0, V_total) or −1. Summed over shards in a fixed order the result is the same
// on every shard; against softmax_xent_forward only the order of the exponentials' sum differs.
void xent_shard_max(float* row_max, const float* logits, int64_t N, int64_t V);
void xent_shard_sums(double* sums, const float* logits, const float* row_max,
                     const int32_t* targets, int64_t v0, int64_t N, int64_t V, int64_t V_total);
void xent_shard_finish(float* losses, float* lse, const float* row_max, const double* sums,
                       const int32_t* targets, int64_t N);
// dlogits (N, V) of the shard = dlosses[i] · (exp(logits_i − lse_i) − onehot(target_i − v0)):
// softmax_xent_backward over the shard's columns, lse the whole row's.
void softmax_xent_shard_backward(float* dlogits, const float* dlosses, const float* logits,
                                 const float* lse, const int32_t* targets, int64_t v0, int64_t N,
                                 int64_t V, int64_t V_total);

// The exponentials of a row as every function above forms them: e[0, n) = exp(x[0, n) − m) · g,
// returning Σ e in double when sum is set; the path chosen by the caller, for tests: wide takes
// the 16-lane AVX-512 path where the CPU has it, else the 8-lane one; both give the same bits.
double softmax_exp_row(bool wide, float* e, const float* x, int64_t n, float m, float g, bool sum);

}  // namespace moetrain
