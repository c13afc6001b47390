// The CUDA engine of the Transformer (model/device_engine.h): the forward and backward of
// model/transformer.cpp, step for step, on the GPU, and the training state it keeps resident for
// the trainer (optim/device_state.h). Internal to src/cuda:
//   engine.cpp        the step: capacity, parameters, forward, backward
//   engine_moe.cpp    the MoE blocks: router GEMMs, layout, experts, combine
//   engine_state.cpp  the resident gradients, AdamW and the host copies
#pragma once
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/check.h"
#include "cuda/device.h"
#include "cuda/kernels.h"
#include "model/device_engine.h"
#include "model/params.h"
#include "moe/dispatch.h"
#include "optim/device_state.h"

namespace moetrain::cuda {

// The device gradient as the update step sees it (optim/update.h). The sums of one pass serve
// both the non-finite check and the norm until the gradient is scaled.
class DeviceGradient final : public GradientShard {
 public:
  DeviceGradient(const cuda::Context& ctx, DeviceBuffer<float>& g) : ctx_(ctx), g_(g) {}
  void invalidate() { have_sums_ = false; }
  bool has_non_finite() const override { return sums().non_finite > 0; }
  double sum_squares() const override { return sums().sum_squares; }
  void scale(float factor) override {
    cuda::scale(g_.data(), g_.size(), factor, ctx_.stream());
    have_sums_ = false;
  }
  void range_sums(const std::vector<WeightedRange>&, double*, double*) const override {
    MOETRAIN_FAIL("train.device = cuda: expert reweighting (grad.expert_reweight) runs on the CPU");
  }
  void scale_ranges(const std::vector<WeightedRange>&) override {
    MOETRAIN_FAIL("train.device = cuda: expert reweighting (grad.expert_reweight) runs on the CPU");
  }

 private:
  const cuda::GradSums& sums() const {
    if (!have_sums_) sums_ = cuda::grad_sums(g_.data(), g_.size(), ctx_.stream());
    have_sums_ = true;
    return sums_;
  }
  const cuda::Context& ctx_;
  DeviceBuffer<float>& g_;
  mutable cuda::GradSums sums_;
  mutable bool have_sums_ = false;
};

// What one block keeps for backward, on the device. N = B·T tokens.
struct DeviceLayer {
  DeviceBuffer<float> ln1, rstd1;  // (N, C), (N)
  DeviceBuffer<float> q, k, v;     // (N, QD), (N, KD), (N, KD); q and k after RoPE
  DeviceBuffer<float> att, lse;    // (N, QD), (B, NH, T)
  DeviceBuffer<float> xmid;        // (N, C)
  DeviceBuffer<float> ln2, rstd2;  // (N, C), (N)
  DeviceBuffer<float> ffn;         // (N, C)
  DeviceBuffer<float> h1, h3, g;   // dense blocks: (N, Fd) each
  // MoE blocks: the layout of this forward (host and device), the permuted rows and the experts'
  // activations.
  DispatchLayout layout;
  DeviceBuffer<int32_t> row_token, slot_row;  // (R), (N, S)
  DeviceBuffer<float> row_weight;             // (R)
  DeviceBuffer<float> xp, a, b, ge, y;        // (R, C), (R, F) ×3, (R, C)
  DeviceBuffer<float> sa, sb, sg;             // shared expert: (N, Fs) ×3
};

class CudaEngine final : public DeviceEngine, public DeviceTrainingState {
 public:
  explicit CudaEngine(Transformer& model)
      : model_(model), cfg_(model.config()), layout_(model.layout()) {
    MOETRAIN_CHECK(cfg_.dim % cfg_.n_heads == 0 && cfg_.n_heads % cfg_.n_kv_heads == 0,
                   "cuda engine: heads do not divide (dim {}, n_heads {}, n_kv_heads {})", cfg_.dim,
                   cfg_.n_heads, cfg_.n_kv_heads);
    params_.resize(layout_.size());
    grads_.resize(layout_.size());
    grads_host_.resize(static_cast<std::size_t>(layout_.size()));
    moe_ = model.moe_layers();
    for (int64_t l = 0; l < cfg_.n_layers; ++l)
      layers_.emplace_back(std::make_unique<DeviceLayer>());
    description_ = "cuda: " + cuda::device_description();
  }

  std::string describe() const override { return description_; }
  DeviceTrainingState& training_state() override { return *this; }
  void synchronize() override { ctx_.sync(); }
  void set_gemm(DeviceGemm g) override;  // engine_state.cpp
  void keep_attention_f32(bool on) override { ctx_.set_attention_f32(on); }
  // Resident, the device copy is the current one: it changes through adamw_step and
  // upload_state only.
  void weights_changed() override { stale_ = !resident_; }

  const float* logits() override {
    const int64_t n = N_ * cfg_.vocab_size;
    logits_host_.resize(static_cast<std::size_t>(n));
    ctx_.sync();
    logits_.download(logits_host_.data(), n);
    return logits_host_.data();
  }

  LossParts forward(const float* params, const int32_t* inputs, const int32_t* targets, int64_t B,
                    int64_t T, const MoeStep& step) override;
  void backward(const float* params, float* grads, float loss_weight) override;

  // The resident training state (optim/device_state.h), in engine_state.cpp.
  void set_resident(bool on) override;
  void zero_grads() override;
  GradientShard& gradient() override;
  void adamw_step(const OptimizerConfig& c, std::span<const ParamRange> groups, float lr,
                  int64_t t) override;
  void download_state(float* params, float* exp_avg, float* exp_avg_sq, int64_t offset,
                      int64_t n) override;
  void upload_state(const float* params, const float* exp_avg, const float* exp_avg_sq,
                    int64_t offset, int64_t n) override;

 private:
  void ensure_capacity(int64_t N);
  void upload_params(const float* params);
  // bf16 GEMMs: the parameters' bf16 copy from the device parameters (engine_state.cpp).
  void refresh_weight_copy();
  void check_range(int64_t offset, int64_t n) const;  // engine_state.cpp
  // The MoE block of layer l (engine_moe.cpp): ffn = MoE(ln2), on the device, routed by moe_[m]
  // on the host.
  void moe_forward(int64_t l, int64_t m, const MoeStep& step);
  void moe_backward(int64_t l, int64_t m, float moe_weight);
  // Experts' SwiGLU over rows [r0, r0 + rows) of xp with the expert at weight offsets w1/w3/w2
  // (F hidden): a, b, g, y of the same rows.
  void expert_forward(const float* xp, float* y, int64_t r0, int64_t rows, const float* w1,
                      const float* w3, const float* w2, int64_t F, float* A, float* Bv, float* G);

  Transformer& model_;
  const ModelConfig& cfg_;
  const ParamLayout& layout_;
  std::vector<MoeLayer*> moe_;
  cuda::Context ctx_;
  std::string description_;
  DeviceBuffer<float> params_, grads_;
  DeviceBuffer<float> exp_avg_, exp_avg_sq_;  // resident: AdamW's moments, same offsets
  DeviceBuffer<uint16_t> params_bf16_;        // bf16 GEMMs: the parameters' copy, same offsets
  bool resident_ = false;
  DeviceGradient gradient_{ctx_, grads_};
  std::vector<float> grads_host_, logits_host_;
  const float* uploaded_from_ = nullptr;
  bool stale_ = true;

  std::vector<std::unique_ptr<DeviceLayer>> layers_;
  int64_t capacity_ = 0, N_ = 0, B_ = 0, T_ = 0;
  bool have_targets_ = false;
  std::vector<int32_t> targets_host_, pos_host_;
  std::vector<float> losses_host_, dlosses_host_, dweight_host_;
  DeviceBuffer<int32_t> inputs_, targets_, pos_;
  DeviceBuffer<float> resid_, lnf_, rstdf_, logits_, lse_, losses_;
  DeviceBuffer<float> dresid_, dxmid_, dln_, dq_, dk_, dv_, datt_, dh1_, dh3_, dg_, dlogits_,
      dlosses_;
  DeviceBuffer<float> router_logits_, dweight_, drouter_;  // (N, E), (N, S), (N, E)
  DeviceBuffer<float> dy_, dxp_, da_, db_, dge_;           // MoE backward scratch
};

}  // namespace moetrain::cuda
