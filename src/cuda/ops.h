// The Transformer's operations on a CUDA device (model/device_ops.h): each one the kernel of the
// same name in cuda/kernels.h or a cuBLAS GEMM (cuda/gemm.h), on one stream, timed as its phase of
// the profile; and the training state it keeps resident for the trainer (optim/device_state.h).
// Internal to src/cuda:
//   ops.cpp        memory, parameters and gradients, the dense operations
//   ops_moe.cpp    the MoE block: router GEMMs, layout, experts, combine
//   ops_state.cpp  the resident gradients, AdamW and the host copies
#pragma once
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/check.h"
#include "cuda/device.h"
#include "cuda/kernels.h"
#include "model/config.h"
#include "model/device_ops.h"
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

// What one MoE block keeps for its backward, on the device: the layout of its forward (host and
// device), the permuted rows and the experts' activations. N tokens, R rows.
struct DeviceMoeActs {
  DispatchLayout layout;
  DeviceBuffer<int32_t> row_token, slot_row;  // (R), (N, S)
  DeviceBuffer<float> row_weight;             // (R)
  DeviceBuffer<float> xp, a, b, ge, y;        // (R, C), (R, F) ×3, (R, C)
  DeviceBuffer<float> sa, sb, sg;             // shared expert: (N, Fs) ×3
  const float* inp = nullptr;                 // the forward's input (N, C), kept by the model
  int64_t N = 0;
};

class CudaOps final : public DeviceOps, public DeviceTrainingState {
 public:
  CudaOps(const ModelConfig& cfg, int64_t n_params);

  // DeviceOps
  std::string describe() const override { return description_; }
  DeviceTrainingState& training_state() override { return *this; }
  void synchronize() override { ctx_.sync(); }
  void set_gemm(DeviceGemm g) override;  // ops_state.cpp
  void keep_attention_f32(bool on) override { ctx_.set_attention_f32(on); }

  // ModelOps: memory, parameters, gradients
  void* allocate(std::size_t bytes) override;
  void deallocate(void* p) override;
  const int32_t* ids(Ints& dev, const int32_t* host, int64_t n) override;
  const float* to_host(std::vector<float>& staging, const float* x, int64_t n) override;
  void bind_params(const float* params) override;
  const float* params() const override { return params_.data(); }
  // Resident, the device copy is the current one: it changes through adamw_step and
  // upload_state only.
  void weights_changed() override { stale_ = !resident_; }
  void begin_grads(const float* params, float* grads) override;
  float* grads() override { return grads_.data(); }
  void end_grads(float* grads) override;

  // ModelOps: the operations. GEMM operands follow the context's mode (no copies kept: round
  // gives null); weights are read from the device parameters.
  const void* round(HalfBuffer&, const float*, int64_t) override { return nullptr; }
  void linear_forward(float* out, const float* inp, const void* inp_lp, int64_t w, int64_t N,
                      int64_t IC, int64_t OC, int64_t ld) override;
  void linear_backward_input(float* dinp, bool acc, const float* dout, const void* dout_lp,
                             int64_t w, int64_t N, int64_t IC, int64_t OC, int64_t ld) override;
  void linear_backward_weight(float* dweight, const float* dout, const void* dout_lp,
                              const float* inp, const void* inp_lp, int64_t N, int64_t IC,
                              int64_t OC, int64_t ld) override;
  void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                         int64_t V) override;
  void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N,
                          int64_t C, int64_t V) override;
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                       int64_t C, float eps) override;
  void add_rmsnorm_forward(float* out, float* rstd, float* xsum, const float* x,
                           const float* weight, int64_t N, int64_t C, float eps) override;
  void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                        const float* weight, const float* rstd, int64_t N, int64_t C,
                        const float* dadd) override;
  void rope_forward(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                    int64_t HS, int64_t T) override;
  void rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t N, int64_t NH,
                     int64_t HS, int64_t T) override;
  void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                         int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) override;
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                          const float* k, const float* v, const float* out, const float* lse,
                          int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) override;
  void swiglu_forward(float* out, const float* a, const float* b, int64_t n) override;
  void swiglu_backward(float* da, float* db, const float* dout, const float* a, const float* b,
                       int64_t n) override;
  void add(float* out, const float* a, const float* b, int64_t n) override;
  void softmax_xent_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                            int64_t N, int64_t V) override;
  void softmax_xent_backward(float* dlogits, float dloss, const float* logits, const float* lse,
                             const int32_t* targets, int64_t N, int64_t V) override;
  // ops_moe.cpp
  void moe_forward(MoeLayer& moe, int64_t l, float* out, const float* inp, int64_t N,
                   const MoeBlockOffsets& o, const MoeStep& step, bool replay) override;
  void moe_backward(MoeLayer& moe, int64_t l, float* dinp, const float* dout,
                    const MoeBlockOffsets& o, float moe_weight) override;

  // DeviceTrainingState (ops_state.cpp)
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
  // bf16 GEMMs: the parameters' bf16 copy from the device parameters (ops_state.cpp).
  void refresh_weight_copy();
  void check_range(int64_t offset, int64_t n) const;  // ops_state.cpp
  DeviceMoeActs& moe_acts(int64_t l);
  // Experts' SwiGLU over rows [r0, r0 + rows) of xp with the expert at weight offsets w1/w3/w2
  // (F hidden): a, b, g, y of the same rows.
  void expert_forward(const float* xp, float* y, int64_t r0, int64_t rows, const float* w1,
                      const float* w3, const float* w2, int64_t F, float* A, float* Bv, float* G);

  const int64_t C_;  // the model's width
  const float theta_;
  const int64_t n_params_;
  cuda::Context ctx_;
  std::string description_;
  DeviceBuffer<float> params_, grads_;
  DeviceBuffer<float> exp_avg_, exp_avg_sq_;  // resident: AdamW's moments, same offsets
  DeviceBuffer<uint16_t> params_bf16_;        // bf16 GEMMs: the parameters' copy, same offsets
  bool resident_ = false;
  DeviceGradient gradient_{ctx_, grads_};
  std::vector<float> grads_host_;
  const float* uploaded_from_ = nullptr;
  bool stale_ = true;

  std::vector<std::unique_ptr<DeviceMoeActs>> moe_acts_;  // by layer, made at its first forward
  std::vector<float> dlosses_host_, dweight_host_;
  DeviceBuffer<float> dlosses_;
  DeviceBuffer<float> router_logits_, dweight_, drouter_;  // (N, E), (N, S), (N, E)
  DeviceBuffer<float> dy_, dxp_, da_, db_, dge_;           // MoE backward scratch
};

}  // namespace moetrain::cuda
