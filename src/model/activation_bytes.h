// The activations the model holds for its backward, by formula: activation_bytes_for
// (model/transformer.h) in two parts, the one count the trainer's memory estimate
// (train/memory_estimate.cpp) and the planner build on.
#pragma once
#include <cstdint>

#include "core/dtype.h"
#include "model/config.h"
#include "moe/recompute.h"

namespace moetrain {

// What the blocks hold (each block's activations and residual input, its MoE layer's routing,
// rows and intermediates: a pipeline stage holds its blocks' share per micro-batch in flight) and
// what the model holds once (the stream leaving the last block, the final norm, the logits, the
// tokens; under recomputation the one set of block activations and the MoE layers' shared
// working buffers), in bytes, after a training forward of B sequences of T tokens.
struct ActivationBytes {
  int64_t blocks = 0, once = 0;
  int64_t total() const { return blocks + once; }
};
// Selective recomputation (Megatron-Core's recompute_modules; the planner's only): activations a
// block does not keep, recomputed element-wise in backward from what it keeps.
//   layernorm: each block's two RMSNorm outputs (and their rounded copies), recomputed from the
//              norm's input and rstd, which stay;
//   moe_act:   the routed experts' activation outputs g = act(a) · b, recomputed from a and b;
//   mla_up_proj: multi-head latent attention's per-head queries, keys and values, recomputed
//              from the latents (the up-projections run again in backward).
// Under recompute = full a block keeps only its input, so the modules drop nothing more.
struct RecomputeModules {
  bool layernorm = false, moe_act = false, mla_up_proj = false;
  bool any() const { return layernorm || moe_act || mla_up_proj; }
};
ActivationBytes activation_parts(const ModelConfig& cfg, int64_t B, int64_t T, Recompute r,
                                 DType lp, int64_t ep = 1, RecomputeModules drop = {});
// The output gradients split backward (the zero_bubble schedule, Transformer::set_split_backward)
// keeps for one micro-batch's deferred weight GEMMs, from its backward to its weight pass: per
// block the attention projections' (q, k, v, o) and a dense layer's FFN's (w1, w2, w3), once the
// LM head's (the logits' gradient); f32, or the rounded copies the GEMMs read in bf16 / fp16.
ActivationBytes deferred_grad_parts(const ModelConfig& cfg, int64_t B, int64_t T, DType lp);

}  // namespace moetrain
