#include "model/classifier.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "kernels/det_gemm.h"
#include "kernels/gemm.h"
#include "kernels/norm.h"
#include "kernels/softmax.h"

namespace moetrain {

void ClassifierConfig::validate() const {
  auto positive = [](const char* key, int64_t v) {
    MOETRAIN_CHECK(v > 0, "model.{} = {}: must be a positive integer", key, v);
  };
  positive("input_dim", input_dim);
  positive("dim", dim);
  positive("n_layers", n_layers);
  MOETRAIN_CHECK(n_classes >= 2, "model.n_classes = {}: must be ≥ 2", n_classes);
  MOETRAIN_CHECK(norm_eps > 0, "model.norm_eps = {}: must be positive", norm_eps);
  MOETRAIN_CHECK(init_std > 0, "model.init_std = {}: must be positive", init_std);
  validate_moe();
}

ClassifierLayout::ClassifierLayout(const ClassifierConfig& cfg) {
  cfg.validate();
  const int64_t C = cfg.dim, D = cfg.input_dim;
  input_proj = add("model.input_proj.weight", {C, D}, true);
  if (cfg.input_bias) input_bias = add("model.input_proj.bias", {C}, false);
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    std::string p = fmt::format("model.layers.{}", l);
    ClassifierBlockOffsets o;
    o.norm = add(p + ".norm.weight", {C}, false);
    static_cast<MoeBlockOffsets&>(o) = add_moe_block(p + ".block_sparse_moe", cfg.moe());
    blocks.push_back(o);
  }
  final_norm = add("model.norm.weight", {C}, false);
  head = add("classifier.weight", {cfg.n_classes, C}, true);
  finish();
}

void init_classifier_params(float* params, const ClassifierLayout& layout,
                            const ClassifierConfig& cfg, uint64_t seed, int64_t tensors_from,
                            int64_t tensors_to) {
  init_table_params(params, layout, cfg.init_std, cfg.n_layers, seed, tensors_from, tensors_to);
}

Classifier::Classifier(const ClassifierConfig& cfg, const MoeContext& ctx)
    : cfg_(cfg), layout_(cfg) {
  for (int64_t l = 0; l < cfg_.n_layers; ++l)
    moe_.push_back(std::make_unique<MoeLayer>(cfg_.moe(), ctx));
}

Classifier::~Classifier() = default;

std::vector<MoeLayer*> Classifier::moe_layers() {
  std::vector<MoeLayer*> out;
  for (auto& m : moe_) out.push_back(m.get());
  return out;
}

std::vector<MoeBlockRef> Classifier::moe_blocks() {
  std::vector<MoeBlockRef> out;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) out.push_back({l, layout_.blocks[l], moe_[l].get()});
  return out;
}

void Classifier::ensure_capacity(int64_t N) {
  if (N <= capacity_) return;
  const int64_t C = cfg_.dim, V = cfg_.n_classes, L = cfg_.n_layers;
  auto sz = [](int64_t n) { return static_cast<std::size_t>(n); };
  labels_.resize(sz(N));
  resid_.resize(sz((L + 1) * N * C));
  ln_.resize(sz(L * N * C)), rstd_.resize(sz(L * N)), ffn_.resize(sz(N * C));
  lnf_.resize(sz(N * C)), rstdf_.resize(sz(N));
  logits_.resize(sz(N * V)), lse_.resize(sz(N)), losses_.resize(sz(N));
  dresid_.resize(sz(N * C)), dln_.resize(sz(N * C)), dx_.resize(sz(N * C));
  dlogits_.resize(sz(N * V)), dlosses_.resize(sz(N));
  capacity_ = N;
}

namespace {

// The dense products of the classifier, cut into tasks of kColBlock output columns whose shapes
// depend only on the problem. Each task is a single-threaded oneDNN call (oneDNN runs
// sequentially inside an active parallel region, which is why even one task runs inside one) and
// no reduction is split, so the results are the same for any thread count (see kernels/det_gemm.h).
// Small products are plain loops on the calling thread, without a parallel region.
constexpr int64_t kColBlock = 32;

// out (N, OC) = inp (N, IC) · Wᵀ;  W (OC, IC)
void dense_forward(float* out, const float* inp, const float* W, int64_t N, int64_t IC,
                   int64_t OC) {
  if (is_small_gemm(N, OC, IC)) return task_gemm(Trans::T, N, OC, IC, inp, W, out, false);
  const int64_t blocks = (OC + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t c0 = b * kColBlock, n = std::min(kColBlock, OC - c0);
    gemm(Trans::N, Trans::T, N, n, IC, inp, W + c0 * IC, out + c0, false, IC, IC, OC);
  }
}

// dinp (N, IC) = dout · W (dinp may be null);  dW (OC, IC) += doutᵀ · inp;  dout (N, OC)
void dense_backward(float* dinp, float* dW, const float* dout, const float* inp, const float* W,
                    int64_t N, int64_t IC, int64_t OC) {
  if (is_small_gemm(N, OC, IC)) {
    if (dinp) task_gemm(Trans::N, N, IC, OC, dout, W, dinp, false);
    return task_gemm_reduce(N, OC, IC, dout, inp, dW, true);
  }
  const int64_t in_blocks = dinp ? (IC + kColBlock - 1) / kColBlock : 0;
  const int64_t w_blocks = (OC + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < in_blocks + w_blocks; ++b) {
    if (b < in_blocks) {
      const int64_t c0 = b * kColBlock, n = std::min(kColBlock, IC - c0);
      gemm(Trans::N, Trans::N, N, n, OC, dout, W + c0, dinp + c0, false, OC, IC, IC);
    } else {
      const int64_t r0 = (b - in_blocks) * kColBlock, n = std::min(kColBlock, OC - r0);
      gemm(Trans::T, Trans::N, n, IC, N, dout + r0, inp, dW + r0 * IC, true, OC, IC, IC);
    }
  }
}

}  // namespace

ClassifierLoss Classifier::forward(const float* params, const float* inputs, const int32_t* labels,
                                   int64_t N, const MoeStep& step) {
  MOETRAIN_CHECK(N > 0, "Classifier::forward: batch {} must be positive", N);
  MOETRAIN_CHECK(params && inputs, "Classifier::forward: null params or inputs");
  const int64_t C = cfg_.dim, D = cfg_.input_dim, V = cfg_.n_classes, L = cfg_.n_layers;
  if (labels) {
    for (int64_t i = 0; i < N; ++i)
      MOETRAIN_CHECK(labels[i] >= 0 && labels[i] < V,
                     "Classifier::forward: label {} of row {} is outside [0, {})", labels[i], i, V);
  }
  const float eps = static_cast<float>(cfg_.norm_eps);
  ensure_capacity(N);
  N_ = N, inputs_ = inputs, have_labels_ = labels != nullptr;
  if (labels) std::memcpy(labels_.data(), labels, sizeof(int32_t) * N);
  // MoeWeights carries mutable views; forward only reads them.
  float* P = const_cast<float*>(params);

  float* x0 = resid_.data();
  dense_forward(x0, inputs, params + layout_.input_proj, N, D, C);
  if (layout_.input_bias >= 0) {
    const float* b = params + layout_.input_bias;
    for (int64_t i = 0; i < N; ++i)
      for (int64_t c = 0; c < C; ++c) x0[i * C + c] += b[c];
  }
  ClassifierLoss out;
  for (int64_t l = 0; l < L; ++l) {
    const ClassifierBlockOffsets& o = layout_.blocks[l];
    const float* x = resid_.data() + l * N * C;
    float* x_out = resid_.data() + (l + 1) * N * C;
    float* ln = ln_.data() + l * N * C;
    rmsnorm_forward(ln, rstd_.data() + l * N, x, params + o.norm, N, C, eps);
    MoeStep s = step;
    s.layer = static_cast<uint64_t>(l);
    moe_[l]->forward(ffn_.data(), ln, N, moe_weights(P, o), s);
    out.aux += moe_[l]->aux_loss();
    out.z += moe_[l]->z_loss();
    for (int64_t i = 0; i < N * C; ++i) x_out[i] = x[i] + ffn_[i];
  }
  out.aux /= static_cast<double>(L), out.z /= static_cast<double>(L);
  rmsnorm_forward(lnf_.data(), rstdf_.data(), resid_.data() + L * N * C,
                  params + layout_.final_norm, N, C, eps);
  dense_forward(logits_.data(), lnf_.data(), params + layout_.head, N, C, V);
  out.n = N;
  if (!labels) return out;

  softmax_xent_forward(losses_.data(), lse_.data(), logits_.data(), labels_.data(), N, V);
  double sum = 0;
  for (int64_t i = 0; i < N; ++i) {
    sum += losses_[i];
    const float* row = logits_.data() + i * V;
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (row[v] > row[best]) best = v;
    out.correct += best == labels_[i];
  }
  out.ce = sum / static_cast<double>(N);
  out.total = out.ce + cfg_.aux_loss_coef * out.aux + cfg_.z_loss_coef * out.z;
  return out;
}

void Classifier::backward(const float* params, float* grads, float loss_weight) {
  MOETRAIN_CHECK(have_labels_, "Classifier::backward needs a forward with labels first");
  MOETRAIN_CHECK(params && grads, "Classifier::backward: null params or grads");
  const int64_t N = N_, C = cfg_.dim, D = cfg_.input_dim, V = cfg_.n_classes, L = cfg_.n_layers;
  float* P = const_cast<float*>(params);

  std::fill(dlosses_.begin(), dlosses_.begin() + N, loss_weight / static_cast<float>(N));
  softmax_xent_backward(dlogits_.data(), dlosses_.data(), logits_.data(), lse_.data(),
                        labels_.data(), N, V);
  dense_backward(dln_.data(), grads + layout_.head, dlogits_.data(), lnf_.data(),
                 params + layout_.head, N, C, V);
  rmsnorm_backward(dresid_.data(), grads + layout_.final_norm, dln_.data(),
                   resid_.data() + L * N * C, params + layout_.final_norm, rstdf_.data(), N, C);

  // The balancing losses are means over the L MoE layers: each layer gets 1/L of their gradient.
  const float moe_weight = loss_weight / static_cast<float>(L);
  for (int64_t l = L - 1; l >= 0; --l) {
    const ClassifierBlockOffsets& o = layout_.blocks[l];
    // dresid_ is ∂L/∂(block output): it reaches the MoE output and the residual unchanged.
    moe_[l]->backward(dln_.data(), dresid_.data(), moe_weights(P, o), moe_weights(grads, o),
                      moe_weight);
    rmsnorm_backward(dx_.data(), grads + o.norm, dln_.data(), resid_.data() + l * N * C,
                     params + o.norm, rstd_.data() + l * N, N, C);
    for (int64_t i = 0; i < N * C; ++i) dresid_[i] += dx_[i];
  }
  dense_backward(nullptr, grads + layout_.input_proj, dresid_.data(), inputs_,
                 params + layout_.input_proj, N, D, C);
  if (layout_.input_bias >= 0) {
    // Rows in order for every column: the same sum whatever the thread count.
    float* gb = grads + layout_.input_bias;
    for (int64_t i = 0; i < N; ++i)
      for (int64_t c = 0; c < C; ++c) gb[c] += dresid_[i * C + c];
  }
}

}  // namespace moetrain
