// What the model needs from an MoE layer, whatever runs it: MoeLayer on one process, or an
// expert-parallel layer (parallel/ep_moe.h) that sends token rows to the ranks owning the experts.
#pragma once
#include <cstdint>
#include <vector>

#include "moe/config.h"

namespace moetrain {

// Routing outcome of the last forward.
struct MoeStats {
  std::vector<int64_t> tokens_per_expert;  // (E) assignments each expert computed, after dropping
  int64_t assignments = 0;                 // assignments the router made, before dropping
  int64_t dropped = 0;                     // assignments dropped for capacity
  double fraction_dropped = 0.0;           // dropped / assignments (0 when there are none)
  int64_t capacity = 0;                    // per-expert capacity in force, 0 = dropless
  int64_t unrouted_tokens = 0;             // tokens that reached no expert
};

// Seconds spent per stage in the last forward plus the backward that followed it.
// a2a: exchanging token rows with other processes (expert parallelism; 0 on one process);
// a2a_wait: the part of it the layer waited for, not hidden behind compute (= a2a without
// overlap; not counted again in total()).
struct MoeTimings {
  double router = 0, permute = 0, experts = 0, shared = 0, combine = 0, losses = 0, a2a = 0;
  double a2a_wait = 0;
  double total() const { return router + permute + experts + shared + combine + losses + a2a; }
};

class MoeBlock {
 public:
  virtual ~MoeBlock() = default;

  // out (N, C) = MoE(inp (N, C)); inp must stay valid and unchanged until backward has run.
  virtual void forward(float* out, const float* inp, int64_t N, const MoeWeights& w,
                       const MoeStep& step) = 0;
  // dinp (N, C) =; parameter gradients += into g. dout (N, C)
  virtual void backward(float* dinp, const float* dout, const MoeWeights& w, const MoeWeights& g,
                        float loss_weight) = 0;

  virtual float aux_loss() const = 0;
  virtual float z_loss() const = 0;
  virtual const MoeStats& stats() const = 0;
  virtual const MoeTimings& timings() const = 0;
  virtual const MoeConfig& config() const = 0;

  // sigmoid_bias: this process's pending loads (E), the update from loads summed over every
  // process, and the bias (E) for checkpoints.
  virtual const int64_t* pending_load() const = 0;
  virtual void apply_bias_update(const int64_t* global_load) = 0;
  virtual float* router_bias() = 0;
};

}  // namespace moetrain
