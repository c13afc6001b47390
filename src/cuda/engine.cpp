// The CUDA engine of the Transformer (model/device_engine.h): the forward and backward of
// model/transformer.cpp, step for step, on the GPU. The parameters live in one device allocation
// with the host layout's offsets; each MoE layer's routing (top-K, capacity, balancing losses,
// statistics) is decided by the model's own MoeLayer on the host from logits computed here, so
// the GPU and the CPU route alike, and only the (N, E) logits, the layout and the (N, S) combine
// gradients cross the bus. Everything else stays on the device: until backward adds the
// gradients into the caller's host buffer, or, resident (the trainer), for good: the update step
// runs on the device gradient and AdamW steps the device parameters and moments.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "cuda/device.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "model/device_engine.h"
#include "model/params.h"
#include "optim/device_state.h"
#include "moe/dispatch.h"
#include "optim/adamw_scalars.h"

namespace moetrain {

namespace {

using cuda::DeviceBuffer;

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
                   "cuda engine: heads do not divide (dim {}, n_heads {}, n_kv_heads {})",
                   cfg_.dim, cfg_.n_heads, cfg_.n_kv_heads);
    params_.resize(layout_.size());
    grads_.resize(layout_.size());
    grads_host_.resize(static_cast<std::size_t>(layout_.size()));
    moe_ = model.moe_layers();
    for (int64_t l = 0; l < cfg_.n_layers; ++l) layers_.emplace_back(std::make_unique<DeviceLayer>());
    description_ = "cuda: " + cuda::device_description();
  }

  std::string describe() const override { return description_; }
  DeviceTrainingState& training_state() override { return *this; }
  void synchronize() override { ctx_.sync(); }
  void set_tf32(bool on) override {
    MOETRAIN_CUBLAS_CHECK(
        cublasSetMathMode(ctx_.blas(), on ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  }
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

  void set_resident(bool on) override {
    resident_ = on;
    if (on && exp_avg_.size() != layout_.size()) {
      exp_avg_.resize(layout_.size()), exp_avg_sq_.resize(layout_.size());
      MOETRAIN_CUDA_CHECK(cudaMemset(exp_avg_.data(), 0, sizeof(float) * layout_.size()));
      MOETRAIN_CUDA_CHECK(cudaMemset(exp_avg_sq_.data(), 0, sizeof(float) * layout_.size()));
    }
  }
  void zero_grads() override {
    MOETRAIN_CUDA_CHECK(
        cudaMemsetAsync(grads_.data(), 0, sizeof(float) * layout_.size(), ctx_.stream()));
    gradient_.invalidate();
  }
  GradientShard& gradient() override {
    gradient_.invalidate();
    return gradient_;
  }
  void adamw_step(const OptimizerConfig& c, std::span<const ParamRange> groups, float lr,
                  int64_t t) override {
    MOETRAIN_CHECK(resident_, "adamw_step: the engine keeps no optimizer state (not resident)");
    MOETRAIN_CHECK(c.kind == OptimizerKind::AdamW, "train.device = cuda steps with AdamW only, "
                   "not {}", optimizer_kind_name(c.kind));
    const AdamWScalars a = adamw_scalars(c.beta1, c.beta2, c.eps, c.weight_decay, lr, t);
    for (const ParamRange& g : groups) {
      MOETRAIN_CHECK(g.offset >= 0 && g.size >= 0 && g.offset + g.size <= layout_.size(),
                     "adamw_step: group [{}, {}) outside the {} parameters", g.offset,
                     g.offset + g.size, layout_.size());
      cuda::adamw_step(params_.data() + g.offset, exp_avg_.data() + g.offset,
                       exp_avg_sq_.data() + g.offset, grads_.data() + g.offset, g.size,
                       g.weight_decay && c.weight_decay != 0.0, a, ctx_.stream());
    }
  }
  void download_state(float* params, float* exp_avg, float* exp_avg_sq, int64_t offset,
                      int64_t n) override {
    check_range(offset, n);
    ctx_.sync();
    params_.download(params, layout_.size());
    copy(exp_avg, exp_avg_.data() + offset, n, cudaMemcpyDeviceToHost);
    copy(exp_avg_sq, exp_avg_sq_.data() + offset, n, cudaMemcpyDeviceToHost);
  }
  void upload_state(const float* params, const float* exp_avg, const float* exp_avg_sq,
                    int64_t offset, int64_t n) override {
    check_range(offset, n);
    ctx_.sync();
    params_.upload(params, layout_.size());
    uploaded_from_ = params;
    stale_ = false;
    copy(exp_avg_.data() + offset, exp_avg, n, cudaMemcpyHostToDevice);
    copy(exp_avg_sq_.data() + offset, exp_avg_sq, n, cudaMemcpyHostToDevice);
  }

 private:
  void ensure_capacity(int64_t N);
  void upload_params(const float* params);
  void check_range(int64_t offset, int64_t n) const {
    MOETRAIN_CHECK(resident_, "the engine keeps no optimizer state (not resident)");
    MOETRAIN_CHECK(offset >= 0 && n >= 0 && offset + n <= layout_.size(),
                   "optimizer state [{}, {}) outside the {} parameters", offset, offset + n,
                   layout_.size());
  }
  static void copy(void* dst, const void* src, int64_t n, cudaMemcpyKind kind) {
    if (n > 0) MOETRAIN_CUDA_CHECK(cudaMemcpy(dst, src, sizeof(float) * n, kind));
  }
  // The MoE block of layer l: ffn = MoE(ln2), on the device, routed by moe_[m] on the host.
  void moe_forward(int64_t l, int64_t m, const MoeStep& step);
  void moe_backward(int64_t l, int64_t m, float moe_weight);
  // Experts' SwiGLU over rows [r0, r0 + rows) of xp with the expert at weight offsets w1/w3/w2
  // (F hidden): a, b, g, y of the same rows.
  void expert_forward(const float* xp, float* y, int64_t r0, int64_t rows,
                      const float* w1, const float* w3, const float* w2, int64_t F, float* A,
                      float* Bv, float* G);

  Transformer& model_;
  const ModelConfig& cfg_;
  const ParamLayout& layout_;
  std::vector<MoeLayer*> moe_;
  cuda::Context ctx_;
  std::string description_;
  DeviceBuffer<float> params_, grads_;
  DeviceBuffer<float> exp_avg_, exp_avg_sq_;  // resident: AdamW's moments, same offsets
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

void CudaEngine::ensure_capacity(int64_t N) {
  if (N <= capacity_) return;
  const int64_t C = cfg_.dim, V = cfg_.vocab_size, HS = cfg_.head_dim();
  const int64_t QD = cfg_.n_heads * HS, KD = cfg_.n_kv_heads * HS;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    DeviceLayer& a = *layers_[l];
    a.ln1.resize(N * C), a.rstd1.resize(N);
    a.q.resize(N * QD), a.k.resize(N * KD), a.v.resize(N * KD);
    a.att.resize(N * QD), a.lse.resize(N * cfg_.n_heads);
    a.xmid.resize(N * C), a.ln2.resize(N * C), a.rstd2.resize(N), a.ffn.resize(N * C);
    if (cfg_.is_dense_layer(l)) {
      const int64_t Fd = cfg_.dense_ffn_hidden();
      a.h1.resize(N * Fd), a.h3.resize(N * Fd), a.g.resize(N * Fd);
    }
  }
  const int64_t Fd = cfg_.dense_every > 0 ? cfg_.dense_ffn_hidden() : 0;
  inputs_.resize(N), targets_.resize(N), pos_.resize(N);
  resid_.resize((cfg_.n_layers + 1) * N * C);
  lnf_.resize(N * C), rstdf_.resize(N);
  logits_.resize(N * V), lse_.resize(N), losses_.resize(N);
  dresid_.resize(N * C), dxmid_.resize(N * C), dln_.resize(N * C);
  dq_.resize(N * QD), dk_.resize(N * KD), dv_.resize(N * KD), datt_.resize(N * QD);
  dh1_.resize(N * Fd), dh3_.resize(N * Fd), dg_.resize(N * Fd);
  dlogits_.resize(N * V), dlosses_.resize(N);
  capacity_ = N;
}

void CudaEngine::upload_params(const float* params) {
  if (!stale_ && params == uploaded_from_) return;
  params_.upload(params, layout_.size());
  uploaded_from_ = params;
  stale_ = false;
}

void CudaEngine::expert_forward(const float* xp, float* y, int64_t r0, int64_t rows, const float* w1, const float* w3, const float* w2,
                                int64_t F, float* A, float* Bv, float* G) {
  const int64_t C = cfg_.dim;
  cuda::linear_forward(ctx_, A + r0 * F, xp + r0 * C, w1, rows, C, F);
  cuda::linear_forward(ctx_, Bv + r0 * F, xp + r0 * C, w3, rows, C, F);
  cuda::swiglu_forward(G + r0 * F, A + r0 * F, Bv + r0 * F, rows * F, ctx_.stream());
  cuda::linear_forward(ctx_, y + r0 * C, G + r0 * F, w2, rows, F, C);
}

void CudaEngine::moe_forward(int64_t l, int64_t m, const MoeStep& step) {
  DeviceLayer& a = *layers_[l];
  MoeLayer& moe = *moe_[m];
  const MoeConfig& mc = moe.config();
  const LayerOffsets& o = layout_.layers[l];
  const int64_t N = N_, C = cfg_.dim, E = mc.E, F = mc.F;
  const float* P = params_.data();
  // Router logits on the device, decisions on the host (the model's own MoE layer).
  router_logits_.resize(N * E);
  cuda::linear_forward(ctx_, router_logits_.data(), a.ln2.data(), P + o.gate, N, C, E);
  float* logits_host = moe.logits_for(N);
  ctx_.sync();
  router_logits_.download(logits_host, N * E);
  if (mc.router == RouterKind::NoisyTopK) {
    cuda::linear_forward(ctx_, router_logits_.data(), a.ln2.data(), P + o.noise, N, C, E);
    ctx_.sync();
    router_logits_.download(moe.noise_logits(), N * E);
  }
  const Routing& r = moe.route(N, step);
  build_layout(a.layout, r);
  const DispatchLayout& lay = a.layout;
  const int64_t R = lay.R, S = lay.S;
  a.row_token.resize(R), a.slot_row.resize(N * S), a.row_weight.resize(R);
  a.row_token.upload(lay.row_token.data(), R);
  a.slot_row.upload(lay.slot_row.data(), N * S);
  a.row_weight.upload(lay.row_weight.data(), R);
  a.xp.resize(R * C), a.y.resize(R * C);
  a.a.resize(R * F), a.b.resize(R * F), a.ge.resize(R * F);
  cuda::permute_forward(a.xp.data(), a.ln2.data(), a.row_token.data(), R, C, ctx_.stream());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = lay.counts[e];
    if (rows == 0) continue;
    expert_forward(a.xp.data(), a.y.data(), lay.offsets[e], rows, P + o.w1 + e * F * C,
                   P + o.w3 + e * F * C, P + o.w2 + e * C * F, F, a.a.data(), a.b.data(),
                   a.ge.data());
  }
  const bool shared = mc.shared_F > 0;
  if (shared) {
    const int64_t Fs = mc.shared_F;
    a.sa.resize(N * Fs), a.sb.resize(N * Fs), a.sg.resize(N * Fs);
    expert_forward(a.ln2.data(), a.ffn.data(), 0, N, P + o.shared_w1, P + o.shared_w3,
                   P + o.shared_w2, Fs, a.sa.data(), a.sb.data(), a.sg.data());
  }
  cuda::combine_forward(a.ffn.data(), a.y.data(), a.slot_row.data(), a.row_weight.data(), N, S, C,
                        shared, ctx_.stream());
  moe.finish_route(lay.counts.data());
}

LossParts CudaEngine::forward(const float* params, const int32_t* inputs, const int32_t* targets,
                              int64_t B, int64_t T, const MoeStep& step) {
  const int64_t N = B * T, C = cfg_.dim, V = cfg_.vocab_size, HS = cfg_.head_dim();
  const int64_t NH = cfg_.n_heads, NKV = cfg_.n_kv_heads, QD = NH * HS, KD = NKV * HS;
  const float eps = static_cast<float>(cfg_.norm_eps), theta = static_cast<float>(cfg_.rope_theta);
  const cudaStream_t s = ctx_.stream();
  ensure_capacity(N);
  upload_params(params);
  B_ = B, T_ = T, N_ = N, have_targets_ = targets != nullptr;
  for (int64_t i = 0; i < N; ++i)
    MOETRAIN_CHECK(inputs[i] >= 0 && inputs[i] < V, "forward: token {} at position {} is not in "
                   "[0, vocab_size = {})", inputs[i], i, V);
  pos_host_.resize(static_cast<std::size_t>(N));
  for (int64_t i = 0; i < N; ++i) pos_host_[i] = static_cast<int32_t>(i % T);
  inputs_.upload(inputs, N);
  pos_.upload(pos_host_.data(), N);
  if (targets) {
    targets_host_.assign(targets, targets + N);
    targets_.upload(targets, N);
  }
  const float* P = params_.data();

  cuda::embedding_forward(resid_.data(), inputs_.data(), P + layout_.embed, N, C, V, s);
  LossParts parts;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const LayerOffsets& o = layout_.layers[l];
    DeviceLayer& a = *layers_[l];
    const float* x = resid_.data() + l * N * C;
    float* x_out = resid_.data() + (l + 1) * N * C;
    cuda::rmsnorm_forward(a.ln1.data(), a.rstd1.data(), x, P + o.ln1, N, C, eps, s);
    cuda::linear_forward(ctx_, a.q.data(), a.ln1.data(), P + o.wq, N, C, QD);
    cuda::linear_forward(ctx_, a.k.data(), a.ln1.data(), P + o.wk, N, C, KD);
    cuda::linear_forward(ctx_, a.v.data(), a.ln1.data(), P + o.wv, N, C, KD);
    cuda::rope_forward(a.q.data(), a.q.data(), pos_.data(), N, NH, HS, theta, s);
    cuda::rope_forward(a.k.data(), a.k.data(), pos_.data(), N, NKV, HS, theta, s);
    cuda::attention_forward(a.att.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), B, T,
                            NH, NKV, HS, s);
    cuda::linear_forward(ctx_, a.xmid.data(), a.att.data(), P + o.wo, N, QD, C);
    cuda::add(a.xmid.data(), a.xmid.data(), x, N * C, s);
    cuda::rmsnorm_forward(a.ln2.data(), a.rstd2.data(), a.xmid.data(), P + o.ln2, N, C, eps, s);
    if (model_.moe_index(l) >= 0) {
      const int64_t m = model_.moe_index(l);
      MoeStep ms = step;
      ms.layer = static_cast<uint64_t>(l);
      moe_forward(l, m, ms);
      parts.aux += moe_[m]->aux_loss();
      parts.z += moe_[m]->z_loss();
    } else {
      const int64_t Fd = cfg_.dense_ffn_hidden();
      cuda::linear_forward(ctx_, a.h1.data(), a.ln2.data(), P + o.mlp_w1, N, C, Fd);
      cuda::linear_forward(ctx_, a.h3.data(), a.ln2.data(), P + o.mlp_w3, N, C, Fd);
      cuda::swiglu_forward(a.g.data(), a.h1.data(), a.h3.data(), N * Fd, s);
      cuda::linear_forward(ctx_, a.ffn.data(), a.g.data(), P + o.mlp_w2, N, Fd, C);
    }
    cuda::add(x_out, a.xmid.data(), a.ffn.data(), N * C, s);
  }
  cuda::rmsnorm_forward(lnf_.data(), rstdf_.data(), resid_.data() + cfg_.n_layers * N * C,
                        P + layout_.final_norm, N, C, eps, s);
  cuda::linear_forward(ctx_, logits_.data(), lnf_.data(), P + layout_.lm_head, N, C, V);
  const int64_t n_moe = cfg_.n_moe_layers();
  if (n_moe > 0) parts.aux /= n_moe, parts.z /= n_moe;
  if (!targets) {
    ctx_.sync();
    return parts;
  }
  cuda::softmax_xent_forward(losses_.data(), lse_.data(), logits_.data(), targets_.data(), N, V,
                             s);
  losses_host_.resize(static_cast<std::size_t>(N));
  ctx_.sync();
  losses_.download(losses_host_.data(), N);
  // The same sum as the CPU's: in token order, in double.
  double sum = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (targets_host_[i] >= 0) sum += losses_host_[i], ++parts.targets;
  }
  parts.ce = parts.targets ? sum / parts.targets : 0.0;
  parts.total = parts.ce + cfg_.aux_loss_coef * parts.aux + cfg_.z_loss_coef * parts.z;
  return parts;
}

void CudaEngine::moe_backward(int64_t l, int64_t m, float moe_weight) {
  DeviceLayer& a = *layers_[l];
  MoeLayer& moe = *moe_[m];
  const MoeConfig& mc = moe.config();
  const LayerOffsets& o = layout_.layers[l];
  const DispatchLayout& lay = a.layout;
  const int64_t N = N_, C = cfg_.dim, E = mc.E, F = mc.F, R = lay.R, S = lay.S;
  const float* P = params_.data();
  float* G = grads_.data();
  const cudaStream_t s = ctx_.stream();
  // dresid_ is ∂L/∂ffn. Combine's backward gives the rows' gradients and the router weights'.
  const bool shared = mc.shared_F > 0;
  const int64_t Fs = mc.shared_F;
  // Sized once before any kernel reads them: the shared expert reuses them after the routed ones.
  const int64_t scratch = std::max(R * F, shared ? N * Fs : 0);
  dy_.resize(R * C), dxp_.resize(R * C), dweight_.resize(N * S);
  da_.resize(scratch), db_.resize(scratch), dge_.resize(scratch);
  cuda::combine_backward(dy_.data(), dweight_.data(), dresid_.data(), a.y.data(),
                         a.slot_row.data(), a.row_weight.data(), N, S, C, s);
  dweight_host_.resize(static_cast<std::size_t>(N * S));
  ctx_.sync();
  dweight_.download(dweight_host_.data(), N * S);
  // The experts, each over its own rows: dg = dy·W2; SwiGLU backward; dxp = da·W1 + db·W3;
  // weight gradients +=.
  auto expert_backward = [&](const float* dy, const float* xp, float* dxp, int64_t r0,
                             int64_t rows, int64_t f, const float* A, const float* Bv,
                             const float* Gv, float* dA, float* dB, float* dG, int64_t w1,
                             int64_t w3, int64_t w2, bool acc) {
    cuda::linear_backward(ctx_, dG + r0 * f, false, G + w2, dy + r0 * C, Gv + r0 * f, P + w2,
                          rows, f, C);
    cuda::swiglu_backward(dA + r0 * f, dB + r0 * f, dG + r0 * f, A + r0 * f, Bv + r0 * f,
                          rows * f, s);
    cuda::linear_backward(ctx_, dxp + r0 * C, acc, G + w1, dA + r0 * f, xp + r0 * C, P + w1, rows,
                          C, f);
    cuda::linear_backward(ctx_, dxp + r0 * C, true, G + w3, dB + r0 * f, xp + r0 * C, P + w3,
                          rows, C, f);
  };
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = lay.counts[e];
    if (rows == 0) continue;
    expert_backward(dy_.data(), a.xp.data(), dxp_.data(), lay.offsets[e], rows, F, a.a.data(),
                    a.b.data(), a.ge.data(), da_.data(), db_.data(), dge_.data(),
                    o.w1 + e * F * C, o.w3 + e * F * C, o.w2 + e * C * F, false);
  }
  if (shared) {
    // The shared expert sees every token: its input gradient starts dln, the routed rows add.
    expert_backward(dresid_.data(), a.ln2.data(), dln_.data(), 0, N, Fs, a.sa.data(), a.sb.data(),
                    a.sg.data(), da_.data(), db_.data(), dge_.data(), o.shared_w1, o.shared_w3,
                    o.shared_w2, false);
  }
  cuda::permute_backward(dln_.data(), dxp_.data(), a.slot_row.data(), N, S, C, shared, s);
  // The router: ∂/∂logits on the host (the MoE layer's own rules, with the balancing losses),
  // then its GEMMs here.
  const float* dl = moe.logit_grads(dweight_host_.data(), moe_weight);
  if (dl == nullptr) return;
  drouter_.resize(N * E);
  drouter_.upload(dl, N * E);
  cuda::linear_backward(ctx_, dln_.data(), true, G + o.gate, drouter_.data(), a.ln2.data(),
                        P + o.gate, N, C, E);
  if (const float* dnl = moe.noise_logit_grads()) {
    ctx_.sync();  // drouter_ is read by the GEMMs above before it is overwritten
    drouter_.upload(dnl, N * E);
    cuda::linear_backward(ctx_, dln_.data(), true, G + o.noise, drouter_.data(), a.ln2.data(),
                          P + o.noise, N, C, E);
  }
}

void CudaEngine::backward(const float* params, float* grads, float loss_weight) {
  MOETRAIN_CHECK(have_targets_, "backward needs a forward with targets first");
  MOETRAIN_CHECK(params == uploaded_from_ && !stale_,
                 "backward: the parameters changed since the forward");
  const int64_t B = B_, T = T_, N = N_, C = cfg_.dim, V = cfg_.vocab_size, HS = cfg_.head_dim();
  const int64_t NH = cfg_.n_heads, NKV = cfg_.n_kv_heads, QD = NH * HS, KD = NKV * HS;
  const float theta = static_cast<float>(cfg_.rope_theta);
  const cudaStream_t s = ctx_.stream();
  const float* P = params_.data();
  float* G = grads_.data();
  // Resident, the step's micro-batches sum here from zero_grads(); else each backward starts at
  // zero and adds its gradients into the caller's buffer at the end.
  if (!resident_) MOETRAIN_CUDA_CHECK(cudaMemsetAsync(G, 0, sizeof(float) * layout_.size(), s));
  gradient_.invalidate();

  int64_t counted = 0;
  for (int64_t i = 0; i < N; ++i) counted += targets_host_[i] >= 0;
  dlosses_host_.assign(static_cast<std::size_t>(N),
                       counted ? loss_weight / static_cast<float>(counted) : 0.f);
  dlosses_.upload(dlosses_host_.data(), N);
  cuda::softmax_xent_backward(dlogits_.data(), dlosses_.data(), logits_.data(), lse_.data(),
                              targets_.data(), N, V, s);
  cuda::linear_backward(ctx_, dln_.data(), false, G + layout_.lm_head, dlogits_.data(),
                        lnf_.data(), P + layout_.lm_head, N, C, V);
  cuda::rmsnorm_backward(dresid_.data(), G + layout_.final_norm, dln_.data(),
                         resid_.data() + cfg_.n_layers * N * C, P + layout_.final_norm,
                         rstdf_.data(), N, C, s);

  const int64_t n_moe = cfg_.n_moe_layers();
  const float moe_weight = n_moe > 0 ? loss_weight / static_cast<float>(n_moe) : 0.f;
  for (int64_t l = cfg_.n_layers - 1; l >= 0; --l) {
    const LayerOffsets& o = layout_.layers[l];
    DeviceLayer& a = *layers_[l];
    const float* x = resid_.data() + l * N * C;
    if (model_.moe_index(l) >= 0) {
      moe_backward(l, model_.moe_index(l), moe_weight);
    } else {
      const int64_t Fd = cfg_.dense_ffn_hidden();
      cuda::linear_backward(ctx_, dg_.data(), false, G + o.mlp_w2, dresid_.data(), a.g.data(),
                            P + o.mlp_w2, N, Fd, C);
      cuda::swiglu_backward(dh1_.data(), dh3_.data(), dg_.data(), a.h1.data(), a.h3.data(),
                            N * Fd, s);
      cuda::linear_backward(ctx_, dln_.data(), false, G + o.mlp_w1, dh1_.data(), a.ln2.data(),
                            P + o.mlp_w1, N, C, Fd);
      cuda::linear_backward(ctx_, dln_.data(), true, G + o.mlp_w3, dh3_.data(), a.ln2.data(),
                            P + o.mlp_w3, N, C, Fd);
    }
    cuda::rmsnorm_backward(dxmid_.data(), G + o.ln2, dln_.data(), a.xmid.data(), P + o.ln2,
                           a.rstd2.data(), N, C, s);
    cuda::add(dxmid_.data(), dxmid_.data(), dresid_.data(), N * C, s);
    cuda::linear_backward(ctx_, datt_.data(), false, G + o.wo, dxmid_.data(), a.att.data(),
                          P + o.wo, N, QD, C);
    cuda::attention_backward(dq_.data(), dk_.data(), dv_.data(), datt_.data(), a.q.data(),
                             a.k.data(), a.v.data(), a.att.data(), a.lse.data(), B, T, NH, NKV,
                             HS, s);
    cuda::rope_backward(dq_.data(), dq_.data(), pos_.data(), N, NH, HS, theta, s);
    cuda::rope_backward(dk_.data(), dk_.data(), pos_.data(), N, NKV, HS, theta, s);
    cuda::linear_backward(ctx_, dln_.data(), false, G + o.wq, dq_.data(), a.ln1.data(), P + o.wq,
                          N, C, QD);
    cuda::linear_backward(ctx_, dln_.data(), true, G + o.wk, dk_.data(), a.ln1.data(), P + o.wk,
                          N, C, KD);
    cuda::linear_backward(ctx_, dln_.data(), true, G + o.wv, dv_.data(), a.ln1.data(), P + o.wv,
                          N, C, KD);
    cuda::rmsnorm_backward(dresid_.data(), G + o.ln1, dln_.data(), x, P + o.ln1, a.rstd1.data(),
                           N, C, s);
    cuda::add(dresid_.data(), dresid_.data(), dxmid_.data(), N * C, s);
  }
  cuda::embedding_backward(G + layout_.embed, dresid_.data(), inputs_.data(), N, C, V, s);
  if (resident_) return;
  // Parameter gradients are +=: this micro-batch's join what the caller holds.
  ctx_.sync();
  grads_.download(grads_host_.data(), layout_.size());
  const int64_t n = layout_.size();
  const float* g = grads_host_.data();
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) grads[i] += g[i];
}

}  // namespace

std::unique_ptr<DeviceEngine> make_cuda_engine(Transformer& model) {
  return std::make_unique<CudaEngine>(model);
}

}  // namespace moetrain
