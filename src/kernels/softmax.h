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

}  // namespace moetrain
