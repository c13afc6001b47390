// One block's attention in the planner: its forward FLOPs and its time, forward + backward, for
// every attention the model config describes — grouped-query heads of model.head_dim, a causal
// sliding window on some blocks (model.sliding_window, model.full_attention_every), and
// multi-head latent attention (model.kv_lora_rank > 0). Each formula once, with its reason.
#pragma once
#include <cstdint>

#include "core/dtype.h"
#include "model/config.h"
#include "plan/cluster.h"

namespace moetrain::plan {

// Forward FLOPs of block `layer`'s attention on a micro-batch of B sequences of T tokens.
struct AttentionFlops {
  double proj = 0;    // the projections' GEMMs (Q, K, V, O; MLA's down- and up-projections)
  double scores = 0;  // q·kᵀ and p·v over the causal (windowed) pairs
};
AttentionFlops attention_forward_flops(const ModelConfig& m, int64_t layer, int64_t B, int64_t T);

// Seconds of block `layer`'s attention on one process, forward + backward: projections at their
// shapes with the heads split over tp, the core (scores and values), RoPE, MLA's latent norms.
// `ab`: bytes of an activation element.
double attention_time(const DeviceModel& dev, DType prec, const ModelConfig& m, int64_t layer,
                      int64_t B, int64_t T, int64_t tp, double ab);

// Seconds selective mla_up_proj recomputation adds to a block (Megatron-Core's recompute module):
// latent attention's up-projections (q from its latent, and the keys' no-rope part and the values
// from theirs) run their forwards again in backward, a third of their forward + backward, the
// heads split over tp; 0 for a model without latent attention.
double mla_up_proj_recompute_time(const DeviceModel& dev, DType prec, const ModelConfig& m,
                                  int64_t B, int64_t T, int64_t tp);

}  // namespace moetrain::plan
