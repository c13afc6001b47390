// The model FLOPs the planner counts (MFU, TFLOP/s per device, tokens against published runs):
// every GEMM of the model as configured and the attention's scores and values over the causal
// pairs each block attends (docs/plan-published.md, "Which FLOPs").
#pragma once
#include <cstdint>

#include "model/config.h"

namespace moetrain::plan {

// Forward FLOPs of one micro-batch of one process at uniform load, by part (no backward).
struct ForwardFlops {
  double attention_proj = 0, attention_scores = 0, router = 0, experts = 0, shared = 0, lm_head = 0;
  double total() const {
    return attention_proj + attention_scores + router + experts + shared + lm_head;
  }
};
ForwardFlops forward_flops(const ModelConfig& m, int64_t B, int64_t T);

}  // namespace moetrain::plan
