// The CUDA engine of the Transformer (model/device_engine.h): the forward and backward of
// model/transformer.cpp, step for step, on the GPU. The parameters live in one device allocation
// with the host layout's offsets; each MoE layer's routing (top-K, capacity, balancing losses,
// statistics) is decided by the model's own MoeLayer on the host from logits computed here, so
// the GPU and the CPU route alike, and only the (N, E) logits, the layout and the (N, S) combine
// gradients cross the bus. Everything else stays on the device: until backward adds the
// gradients into the caller's host buffer, or, resident (the trainer), for good: the update step
// runs on the device gradient and AdamW steps the device parameters and moments.
#include "cuda/engine.h"

#include <fmt/format.h>

#include <optional>

#include "cuda/gemm.h"

namespace moetrain {
namespace cuda {

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
  refresh_weight_copy();
  uploaded_from_ = params;
  stale_ = false;
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
  std::optional<DevicePhase> data(std::in_place, ctx_, Phase::Data);
  for (int64_t i = 0; i < N; ++i)
    MOETRAIN_CHECK(inputs[i] >= 0 && inputs[i] < V,
                   "forward: token {} at position {} is not in "
                   "[0, vocab_size = {})",
                   inputs[i], i, V);
  pos_host_.resize(static_cast<std::size_t>(N));
  for (int64_t i = 0; i < N; ++i) pos_host_[i] = static_cast<int32_t>(i % T);
  inputs_.upload(inputs, N);
  pos_.upload(pos_host_.data(), N);
  if (targets) {
    targets_host_.assign(targets, targets + N);
    targets_.upload(targets, N);
  }
  const float* P = params_.data();
  data.reset();

  {
    DevicePhase ph(ctx_, Phase::Embedding);
    cuda::embedding_forward(resid_.data(), inputs_.data(), P + layout_.embed, N, C, V, s);
  }
  LossParts parts;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const LayerOffsets& o = layout_.layers[l];
    DeviceLayer& a = *layers_[l];
    const float* x = resid_.data() + l * N * C;
    float* x_out = resid_.data() + (l + 1) * N * C;
    {
      DevicePhase ph(ctx_, Phase::Norm);
      cuda::rmsnorm_forward(a.ln1.data(), a.rstd1.data(), x, P + o.ln1, N, C, eps, s);
    }
    {
      DevicePhase ph(ctx_, Phase::Gemm);
      cuda::linear_forward(ctx_, a.q.data(), a.ln1.data(), P + o.wq, N, C, QD);
      cuda::linear_forward(ctx_, a.k.data(), a.ln1.data(), P + o.wk, N, C, KD);
      cuda::linear_forward(ctx_, a.v.data(), a.ln1.data(), P + o.wv, N, C, KD);
    }
    {
      DevicePhase ph(ctx_, Phase::Rope);
      cuda::rope_forward(a.q.data(), a.q.data(), pos_.data(), N, NH, HS, theta, s);
      cuda::rope_forward(a.k.data(), a.k.data(), pos_.data(), N, NKV, HS, theta, s);
    }
    {
      DevicePhase ph(ctx_, Phase::Attention);
      cuda::attention_forward(ctx_, a.att.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(),
                              B, T, NH, NKV, HS);
    }
    {
      DevicePhase ph(ctx_, Phase::Gemm);
      cuda::linear_forward(ctx_, a.xmid.data(), a.att.data(), P + o.wo, N, QD, C);
    }
    {
      DevicePhase ph(ctx_, Phase::Norm);  // with the residual add before it
      cuda::add(a.xmid.data(), a.xmid.data(), x, N * C, s);
      cuda::rmsnorm_forward(a.ln2.data(), a.rstd2.data(), a.xmid.data(), P + o.ln2, N, C, eps, s);
    }
    if (model_.moe_index(l) >= 0) {
      const int64_t m = model_.moe_index(l);
      MoeStep ms = step;
      ms.layer = static_cast<uint64_t>(l);
      moe_forward(l, m, ms);
      parts.aux += moe_[m]->aux_loss();
      parts.z += moe_[m]->z_loss();
    } else {
      const int64_t Fd = cfg_.dense_ffn_hidden();
      DevicePhase ph(ctx_, Phase::Gemm);  // with its SwiGLU
      cuda::linear_forward(ctx_, a.h1.data(), a.ln2.data(), P + o.mlp_w1, N, C, Fd);
      cuda::linear_forward(ctx_, a.h3.data(), a.ln2.data(), P + o.mlp_w3, N, C, Fd);
      cuda::swiglu_forward(a.g.data(), a.h1.data(), a.h3.data(), N * Fd, s);
      cuda::linear_forward(ctx_, a.ffn.data(), a.g.data(), P + o.mlp_w2, N, Fd, C);
    }
    DevicePhase ph(ctx_, Phase::Norm);  // the residual add
    cuda::add(x_out, a.xmid.data(), a.ffn.data(), N * C, s);
  }
  {
    DevicePhase ph(ctx_, Phase::Norm);
    cuda::rmsnorm_forward(lnf_.data(), rstdf_.data(), resid_.data() + cfg_.n_layers * N * C,
                          P + layout_.final_norm, N, C, eps, s);
  }
  {
    DevicePhase ph(ctx_, Phase::Gemm);
    cuda::linear_forward(ctx_, logits_.data(), lnf_.data(), P + layout_.lm_head, N, C, V);
  }
  const int64_t n_moe = cfg_.n_moe_layers();
  if (n_moe > 0) parts.aux /= n_moe, parts.z /= n_moe;
  if (!targets) {
    ctx_.sync();
    return parts;
  }
  DevicePhase ph(ctx_, Phase::Loss);
  cuda::softmax_xent_forward(losses_.data(), lse_.data(), logits_.data(), targets_.data(), N, V, s);
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

  std::optional<DevicePhase> loss(std::in_place, ctx_, Phase::Loss);
  int64_t counted = 0;
  for (int64_t i = 0; i < N; ++i) counted += targets_host_[i] >= 0;
  dlosses_host_.assign(static_cast<std::size_t>(N),
                       counted ? loss_weight / static_cast<float>(counted) : 0.f);
  dlosses_.upload(dlosses_host_.data(), N);
  cuda::softmax_xent_backward(dlogits_.data(), dlosses_.data(), logits_.data(), lse_.data(),
                              targets_.data(), N, V, s);
  loss.reset();
  {
    DevicePhase ph(ctx_, Phase::Gemm);
    cuda::linear_backward(ctx_, dln_.data(), false, G + layout_.lm_head, dlogits_.data(),
                          lnf_.data(), P + layout_.lm_head, N, C, V);
  }
  {
    DevicePhase ph(ctx_, Phase::Norm);
    cuda::rmsnorm_backward(dresid_.data(), G + layout_.final_norm, dln_.data(),
                           resid_.data() + cfg_.n_layers * N * C, P + layout_.final_norm,
                           rstdf_.data(), N, C, s);
  }

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
      DevicePhase ph(ctx_, Phase::Gemm);  // with its SwiGLU
      cuda::linear_backward(ctx_, dg_.data(), false, G + o.mlp_w2, dresid_.data(), a.g.data(),
                            P + o.mlp_w2, N, Fd, C);
      cuda::swiglu_backward(dh1_.data(), dh3_.data(), dg_.data(), a.h1.data(), a.h3.data(), N * Fd,
                            s);
      cuda::linear_backward(ctx_, dln_.data(), false, G + o.mlp_w1, dh1_.data(), a.ln2.data(),
                            P + o.mlp_w1, N, C, Fd);
      cuda::linear_backward(ctx_, dln_.data(), true, G + o.mlp_w3, dh3_.data(), a.ln2.data(),
                            P + o.mlp_w3, N, C, Fd);
    }
    {
      DevicePhase ph(ctx_, Phase::Norm);
      cuda::rmsnorm_backward(dxmid_.data(), G + o.ln2, dln_.data(), a.xmid.data(), P + o.ln2,
                             a.rstd2.data(), N, C, s);
      cuda::add(dxmid_.data(), dxmid_.data(), dresid_.data(), N * C, s);
    }
    {
      DevicePhase ph(ctx_, Phase::Gemm);
      cuda::linear_backward(ctx_, datt_.data(), false, G + o.wo, dxmid_.data(), a.att.data(),
                            P + o.wo, N, QD, C);
    }
    {
      DevicePhase ph(ctx_, Phase::Attention);
      cuda::attention_backward(ctx_, dq_.data(), dk_.data(), dv_.data(), datt_.data(), a.q.data(),
                               a.k.data(), a.v.data(), a.att.data(), a.lse.data(), B, T, NH, NKV,
                               HS);
    }
    {
      DevicePhase ph(ctx_, Phase::Rope);
      cuda::rope_backward(dq_.data(), dq_.data(), pos_.data(), N, NH, HS, theta, s);
      cuda::rope_backward(dk_.data(), dk_.data(), pos_.data(), N, NKV, HS, theta, s);
    }
    {
      DevicePhase ph(ctx_, Phase::Gemm);
      cuda::linear_backward(ctx_, dln_.data(), false, G + o.wq, dq_.data(), a.ln1.data(), P + o.wq,
                            N, C, QD);
      cuda::linear_backward(ctx_, dln_.data(), true, G + o.wk, dk_.data(), a.ln1.data(), P + o.wk,
                            N, C, KD);
      cuda::linear_backward(ctx_, dln_.data(), true, G + o.wv, dv_.data(), a.ln1.data(), P + o.wv,
                            N, C, KD);
    }
    DevicePhase ph(ctx_, Phase::Norm);
    cuda::rmsnorm_backward(dresid_.data(), G + o.ln1, dln_.data(), x, P + o.ln1, a.rstd1.data(), N,
                           C, s);
    cuda::add(dresid_.data(), dresid_.data(), dxmid_.data(), N * C, s);
  }
  {
    DevicePhase ph(ctx_, Phase::Embedding);
    cuda::embedding_backward(G + layout_.embed, dresid_.data(), inputs_.data(), N, C, V, s);
  }
  if (resident_) return;
  // Parameter gradients are +=: this micro-batch's join what the caller holds.
  ctx_.sync();
  grads_.download(grads_host_.data(), layout_.size());
  const int64_t n = layout_.size();
  const float* g = grads_host_.data();
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) grads[i] += g[i];
}

}  // namespace cuda

std::unique_ptr<DeviceEngine> make_cuda_engine(Transformer& model) {
  return std::make_unique<cuda::CudaEngine>(model);
}

}  // namespace moetrain
