// One Mixture-of-Experts layer: tokens (N, C) in, (N, C) out, exact backward.
// The forward runs as separable stages, each a public function of its own file:
//   route (router.h) → capacity + layout (dispatch.h) → permute → experts (experts.h) → combine
// so that an expert-parallel layer can put an all-to-all after permute and after experts.
#pragma once
#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "moe/config.h"
#include "moe/dispatch.h"
#include "moe/experts.h"
#include "moe/moe_block.h"
#include "moe/router.h"

namespace moetrain {

class MoeLayer : public MoeBlock {
 public:
  explicit MoeLayer(const MoeConfig& cfg);

  // out (N, C) = MoE(inp (N, C)). Keeps what backward needs until the next forward; inp is not
  // copied, so it must stay valid and unchanged until backward has run.
  void forward(float* out, const float* inp, int64_t N, const MoeWeights& w,
               const MoeStep& step) override;
  // dinp (N, C) =; parameter gradients += into g (an expert that got no tokens is left untouched);
  // adds loss_weight · (aux_loss_coef · ∂L_aux + z_loss_coef · ∂L_z). dout (N, C)
  void backward(float* dinp, const float* dout, const MoeWeights& w, const MoeWeights& g,
                float loss_weight) override;

  // Unweighted balancing losses of the last forward (aux is 0 for expert_choice and sigmoid_bias).
  float aux_loss() const override { return aux_loss_; }
  float z_loss() const override { return z_loss_; }
  const MoeStats& stats() const override { return stats_; }
  const MoeTimings& timings() const override { return timings_; }
  const Routing& routing() const { return routing_; }
  const DispatchLayout& layout() const { return layout_; }
  const MoeConfig& config() const override { return cfg_; }

  // sigmoid_bias. Assignments per expert (E) chosen by training forwards since the last update,
  // before capacity dropping; a distributed trainer sums them over ranks and hands the sum to
  // apply_bias_update, which applies b_i += γ·sign(mean − load_i) and clears the pending counts.
  const int64_t* pending_load() const override { return pending_load_.data(); }
  void apply_bias_update(const int64_t* global_load) override;
  void apply_bias_update() { apply_bias_update(pending_load_.data()); }
  // The bias b (E), for checkpoints.
  float* router_bias() override { return bias_.data(); }
  const float* router_bias() const { return bias_.data(); }

 private:
  MoeConfig cfg_;
  std::vector<float> bias_;
  std::vector<int64_t> pending_load_;

  // State of the last forward.
  bool has_forward_ = false;
  int64_t N_ = 0;
  const float* inp_ = nullptr;
  Routing routing_;
  RouterCache router_cache_;
  DispatchLayout layout_;
  std::vector<float> frac_;  // (E) f_i of the aux loss
  float aux_loss_ = 0.0f, z_loss_ = 0.0f;
  MoeStats stats_;
  MoeTimings timings_;
  FloatBuffer xp_, y_, dy_, dxp_;  // (R, C)
  ExpertActs acts_, shared_acts_;
  std::vector<float> dweight_, dprobs_, dz_;  // (N, S), (N, E), (N, E)
};

}  // namespace moetrain
