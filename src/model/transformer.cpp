#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "kernels/activation.h"
#include "kernels/attention.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"
#include "kernels/norm.h"
#include "kernels/rope.h"
#include "kernels/softmax.h"
#include "model/device_engine.h"

namespace moetrain {

// What one block keeps for backward. N = B·T tokens.
struct Transformer::LayerActs {
  std::vector<float> ln1, rstd1;  // (N, C), (N)
  std::vector<float> q, k, v;     // (N, NH·HS), (N, NKV·HS), (N, NKV·HS); q and k after RoPE
  std::vector<float> att, lse;    // (N, NH·HS), (B, NH, T)
  std::vector<float> xmid;        // (N, C) residual after attention
  std::vector<float> ln2, rstd2;  // (N, C), (N)
  std::vector<float> ffn;         // (N, C) MoE or dense output
  std::vector<float> h1, h3, g;   // dense blocks only: (N, Fd) each
  // Mixed precision: GEMM inputs rounded, kept for the weight gradients. (N, C), (N, NH·HS),
  // (N, C) dense blocks only, (N, Fd) dense blocks only.
  HalfBuffer ln1_lp, att_lp, ln2_lp, g_lp;
};

Transformer::Transformer(const ModelConfig& cfg, const MoeContext& ctx) : cfg_(cfg), layout_(cfg) {
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    if (cfg_.is_dense_layer(l)) {
      moe_index_.push_back(-1);
    } else {
      moe_index_.push_back(static_cast<int64_t>(moe_.size()));
      moe_.push_back(std::make_unique<MoeLayer>(cfg_.moe(), ctx));
    }
    acts_.push_back(std::make_unique<LayerActs>());
  }
}

Transformer::~Transformer() = default;

void Transformer::set_device(const std::string& device) {
  MOETRAIN_CHECK(device == "cpu" || device == "cuda", "device '{}': allowed are cpu, cuda",
                 device);
  engine_ = device == "cuda" ? make_cuda_engine(*this) : nullptr;
}

const float* Transformer::logits() {
  return engine_ ? engine_->logits() : logits_.data();
}

void Transformer::weights_changed() {
  lp_stale_ = true;
  if (engine_) engine_->weights_changed();
}

LowPrecisionCopy Transformer::lp_copy_of(const float* params) {
  if (lp_ == DType::F32 || lp_stale_ || params != lp_source_) return {};
  return {lp_, params_lp_.data()};
}

void Transformer::weights_changed_copy_kept() {
  if (engine_) engine_->weights_changed();
}

bool Transformer::bf16_attention(int64_t T) const {
  return lp_ == DType::BF16 && attention_bf16_pays(T, cfg_.head_dim());
}

void Transformer::set_precision(DType t) {
  lp_ = t;
  lp_stale_ = true;
}

const void* Transformer::lp_weight(int64_t offset) const {
  return static_cast<const char*>(params_lp_.data()) + offset * 2;
}

const void* Transformer::rounded(HalfBuffer& buf, const float* x, int64_t n) {
  void* p = buf.ensure(n);
  f32_to_dtype(lp_, p, x, static_cast<std::size_t>(n));
  return p;
}

std::vector<MoeLayer*> Transformer::moe_layers() {
  std::vector<MoeLayer*> out;
  for (auto& m : moe_) out.push_back(m.get());
  return out;
}

std::vector<MoeBlockRef> Transformer::moe_blocks() {
  std::vector<MoeBlockRef> out;
  for (int64_t l = 0; l < cfg_.n_layers; ++l)
    if (const int64_t m = moe_index_[l]; m >= 0)
      out.push_back({l, layout_.layers[l], moe_[m].get()});
  return out;
}

void Transformer::ensure_capacity(int64_t N) {
  if (N <= capacity_) return;
  const int64_t C = cfg_.dim, V = cfg_.vocab_size, HS = cfg_.head_dim();
  const int64_t QD = cfg_.n_heads * HS, KD = cfg_.n_kv_heads * HS;
  auto sz = [](int64_t n) { return static_cast<std::size_t>(n); };
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    LayerActs& a = *acts_[l];
    a.ln1.resize(sz(N * C)), a.rstd1.resize(sz(N));
    a.q.resize(sz(N * QD)), a.k.resize(sz(N * KD)), a.v.resize(sz(N * KD));
    a.att.resize(sz(N * QD)), a.lse.resize(sz(N * cfg_.n_heads));
    a.xmid.resize(sz(N * C)), a.ln2.resize(sz(N * C)), a.rstd2.resize(sz(N)),
        a.ffn.resize(sz(N * C));
    if (cfg_.is_dense_layer(l)) {
      const int64_t Fd = cfg_.dense_ffn_hidden();
      a.h1.resize(sz(N * Fd)), a.h3.resize(sz(N * Fd)), a.g.resize(sz(N * Fd));
    }
  }
  const int64_t Fd = cfg_.dense_every > 0 ? cfg_.dense_ffn_hidden() : 0;
  inputs_.resize(sz(N)), targets_.resize(sz(N)), pos_.resize(sz(N));
  resid_.resize(sz((cfg_.n_layers + 1) * N * C));
  lnf_.resize(sz(N * C)), rstdf_.resize(sz(N));
  logits_.resize(sz(N * V)), lse_.resize(sz(N)), losses_.resize(sz(N));
  dresid_.resize(sz(N * C)), dxmid_.resize(sz(N * C)), dln_.resize(sz(N * C));
  dq_.resize(sz(N * QD)), dk_.resize(sz(N * KD)), dv_.resize(sz(N * KD)), datt_.resize(sz(N * QD));
  dh1_.resize(sz(N * Fd)), dh3_.resize(sz(N * Fd)), dg_.resize(sz(N * Fd));
  dlogits_.resize(sz(N * V));
  capacity_ = N;
}

void Transformer::refresh_lp_weights(const float* params) {
  if (lp_ == DType::F32 || (!lp_stale_ && params == lp_source_)) return;
  f32_to_dtype(lp_, params_lp_.ensure(layout_.size()), params,
               static_cast<std::size_t>(layout_.size()));
  lp_source_ = params;
  lp_stale_ = false;
}

namespace {
// C (M, N) = A (M, K) · Bᵀ: the forward of a layer with weights stored (OC, IC), in t.
void lp_linear(DType t, float* out, const void* inp, const void* w, int64_t N, int64_t IC,
               int64_t OC) {
  gemm(t, Trans::N, Trans::T, N, OC, IC, inp, w, out, false);
}
}  // namespace

LossParts Transformer::forward(const float* params, const int32_t* inputs, const int32_t* targets,
                               int64_t B, int64_t T, const MoeStep& step) {
  MOETRAIN_CHECK(B > 0 && T > 0, "forward: batch {} and sequence {} must be positive", B, T);
  MOETRAIN_CHECK(T <= cfg_.max_seq_len,
                 "forward: sequence length {} exceeds model.max_seq_len = {}", T, cfg_.max_seq_len);
  if (engine_) return engine_->forward(params, inputs, targets, B, T, step);
  const int64_t N = B * T, C = cfg_.dim, V = cfg_.vocab_size, HS = cfg_.head_dim();
  const int64_t NH = cfg_.n_heads, NKV = cfg_.n_kv_heads, QD = NH * HS, KD = NKV * HS;
  const float eps = static_cast<float>(cfg_.norm_eps), theta = static_cast<float>(cfg_.rope_theta);
  ensure_capacity(N);
  B_ = B, T_ = T, have_targets_ = targets != nullptr;
  std::memcpy(inputs_.data(), inputs, sizeof(int32_t) * N);
  if (targets) std::memcpy(targets_.data(), targets, sizeof(int32_t) * N);
  for (int64_t i = 0; i < N; ++i) pos_[i] = static_cast<int32_t>(i % T);
  float* P =
      const_cast<float*>(params);  // MoeWeights carries mutable views; forward only reads them
  const bool mixed = lp_ != DType::F32;
  refresh_lp_weights(params);
  // out (N, OC) = inp (N, IC) · Wᵀ; in mixed precision from inp_lp, inp rounded.
  auto linear = [&](float* out, const float* inp, const void* inp_lp, int64_t w, int64_t IC,
                    int64_t OC) {
    if (mixed) {
      lp_linear(lp_, out, inp_lp, lp_weight(w), N, IC, OC);
    } else {
      linear_forward(out, inp, params + w, N, IC, OC);
    }
  };

  embedding_forward(resid_.data(), inputs_.data(), params + layout_.embed, N, C, V);
  LossParts parts;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const LayerOffsets& o = layout_.layers[l];
    LayerActs& a = *acts_[l];
    const float* x = resid_.data() + l * N * C;
    float* x_out = resid_.data() + (l + 1) * N * C;
    rmsnorm_forward(a.ln1.data(), a.rstd1.data(), x, params + o.ln1, N, C, eps);
    const void* ln1 = mixed ? rounded(a.ln1_lp, a.ln1.data(), N * C) : nullptr;
    linear(a.q.data(), a.ln1.data(), ln1, o.wq, C, QD);
    linear(a.k.data(), a.ln1.data(), ln1, o.wk, C, KD);
    linear(a.v.data(), a.ln1.data(), ln1, o.wv, C, KD);
    rope_forward(a.q.data(), a.q.data(), pos_.data(), N, NH, HS, theta);
    rope_forward(a.k.data(), a.k.data(), pos_.data(), N, NKV, HS, theta);
    (bf16_attention(T) ? attention_forward_bf16 : attention_forward)(
        a.att.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), B, T, NH, NKV, HS);
    const void* att = mixed ? rounded(a.att_lp, a.att.data(), N * QD) : nullptr;
    linear(a.xmid.data(), a.att.data(), att, o.wo, QD, C);
    for (int64_t i = 0; i < N * C; ++i) a.xmid[i] += x[i];
    rmsnorm_forward(a.ln2.data(), a.rstd2.data(), a.xmid.data(), params + o.ln2, N, C, eps);
    if (moe_index_[l] >= 0) {
      MoeLayer& moe = *moe_[moe_index_[l]];
      MoeStep s = step;
      s.layer = static_cast<uint64_t>(l);
      moe.forward(a.ffn.data(), a.ln2.data(), N, moe_weights(P, o, lp_, params_lp_.data()), s);
      parts.aux += moe.aux_loss();
      parts.z += moe.z_loss();
    } else {
      const int64_t Fd = cfg_.dense_ffn_hidden();
      const void* ln2 = mixed ? rounded(a.ln2_lp, a.ln2.data(), N * C) : nullptr;
      linear(a.h1.data(), a.ln2.data(), ln2, o.mlp_w1, C, Fd);
      linear(a.h3.data(), a.ln2.data(), ln2, o.mlp_w3, C, Fd);
      swiglu_forward(a.g.data(), a.h1.data(), a.h3.data(), N * Fd);
      const void* g = mixed ? rounded(a.g_lp, a.g.data(), N * Fd) : nullptr;
      linear(a.ffn.data(), a.g.data(), g, o.mlp_w2, Fd, C);
    }
    for (int64_t i = 0; i < N * C; ++i) x_out[i] = a.xmid[i] + a.ffn[i];
  }
  rmsnorm_forward(lnf_.data(), rstdf_.data(), resid_.data() + cfg_.n_layers * N * C,
                  params + layout_.final_norm, N, C, eps);
  const void* lnf = mixed ? rounded(lnf_lp_, lnf_.data(), N * C) : nullptr;
  linear(logits_.data(), lnf_.data(), lnf, layout_.lm_head, C, V);
  const int64_t n_moe = cfg_.n_moe_layers();
  if (n_moe > 0) parts.aux /= n_moe, parts.z /= n_moe;
  if (!targets) return parts;

  softmax_xent_forward(losses_.data(), lse_.data(), logits_.data(), targets_.data(), N, V);
  double sum = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (targets_[i] >= 0) sum += losses_[i], ++parts.targets;
  }
  parts.ce = parts.targets ? sum / parts.targets : 0.0;
  parts.total = parts.ce + cfg_.aux_loss_coef * parts.aux + cfg_.z_loss_coef * parts.z;
  return parts;
}

KvCache Transformer::make_kv_cache(int64_t capacity) const {
  MOETRAIN_CHECK(capacity > 0 && capacity <= cfg_.max_seq_len,
                 "KV cache of {} positions: must be in [1, model.max_seq_len = {}]", capacity,
                 cfg_.max_seq_len);
  KvCache c;
  c.capacity = capacity;
  const auto n = static_cast<std::size_t>(capacity * cfg_.n_kv_heads * cfg_.head_dim());
  c.k.assign(static_cast<std::size_t>(cfg_.n_layers), std::vector<float>(n));
  c.v = c.k;
  return c;
}

const float* Transformer::prefill(const float* params, const int32_t* tokens, int64_t n,
                                  KvCache& cache) {
  MOETRAIN_CHECK(n > 0 && n <= cache.capacity,
                 "prefill: {} tokens for a KV cache of {} positions", n, cache.capacity);
  MOETRAIN_CHECK(static_cast<int64_t>(cache.k.size()) == cfg_.n_layers,
                 "prefill: the KV cache has {} layers, the model {}", cache.k.size(),
                 cfg_.n_layers);
  MOETRAIN_CHECK(!engine_, "prefill: decoding runs on the CPU (set_device(\"cpu\") first)");
  MoeStep step;
  step.training = false;
  forward(params, tokens, nullptr, 1, n, step);
  const int64_t KD = cfg_.n_kv_heads * cfg_.head_dim();
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    std::copy_n(acts_[l]->k.data(), n * KD, cache.k[l].data());
    std::copy_n(acts_[l]->v.data(), n * KD, cache.v[l].data());
  }
  cache.length = n;
  return logits_.data() + (n - 1) * cfg_.vocab_size;
}

void Transformer::backward(const float* params, float* grads, float loss_weight) {
  if (engine_) return engine_->backward(params, grads, loss_weight);
  MOETRAIN_CHECK(have_targets_, "backward needs a forward with targets first");
  const int64_t B = B_, T = T_, N = B * T, C = cfg_.dim, V = cfg_.vocab_size, HS = cfg_.head_dim();
  const int64_t NH = cfg_.n_heads, NKV = cfg_.n_kv_heads, QD = NH * HS, KD = NKV * HS;
  const float theta = static_cast<float>(cfg_.rope_theta);
  float* P = const_cast<float*>(params);
  const bool mixed = lp_ != DType::F32;
  // dinp (N, IC) = (or += with acc) dout (N, OC) · W (may be null); dweight (OC, IC) += doutᵀ ·
  // inp. In mixed precision dout is rounded here and inp_lp is the forward's rounded inp.
  auto linear_bwd = [&](float* dinp, bool acc, float* dweight, const float* dout, const float* inp,
                        const void* inp_lp, int64_t w, int64_t IC, int64_t OC) {
    if (!mixed) {
      if (dinp) gemm(Trans::N, Trans::N, N, IC, OC, dout, params + w, dinp, acc);
      gemm(Trans::T, Trans::N, OC, IC, N, dout, inp, dweight, true);
      return;
    }
    const void* d = rounded(dout_lp_, dout, N * OC);
    if (dinp) gemm(lp_, Trans::N, Trans::N, N, IC, OC, d, lp_weight(w), dinp, acc);
    gemm(lp_, Trans::T, Trans::N, OC, IC, N, d, inp_lp, dweight, true);
  };

  int64_t counted = 0;
  for (int64_t i = 0; i < N; ++i) counted += targets_[i] >= 0;
  // d(mean CE)/d loss_i = 1 / counted; positions with target −1 get no gradient.
  std::vector<float> dlosses(static_cast<std::size_t>(N),
                             counted ? loss_weight / static_cast<float>(counted) : 0.f);
  softmax_xent_backward(dlogits_.data(), dlosses.data(), logits_.data(), lse_.data(),
                        targets_.data(), N, V);
  linear_bwd(dln_.data(), false, grads + layout_.lm_head, dlogits_.data(), lnf_.data(),
             lnf_lp_.data(), layout_.lm_head, C, V);
  rmsnorm_backward(dresid_.data(), grads + layout_.final_norm, dln_.data(),
                   resid_.data() + cfg_.n_layers * N * C, params + layout_.final_norm,
                   rstdf_.data(), N, C);
  if (grads_ready_) grads_ready_(layout_.final_norm);

  // The balancing losses are means over MoE layers: each layer's share of their gradient.
  const int64_t n_moe = cfg_.n_moe_layers();
  const float moe_weight = n_moe > 0 ? loss_weight / static_cast<float>(n_moe) : 0.f;
  for (int64_t l = cfg_.n_layers - 1; l >= 0; --l) {
    const LayerOffsets& o = layout_.layers[l];
    LayerActs& a = *acts_[l];
    const float* x = resid_.data() + l * N * C;
    // dresid_ holds ∂L/∂(block output); it flows unchanged into the FFN output and the residual.
    if (moe_index_[l] >= 0) {
      moe_[moe_index_[l]]->backward(dln_.data(), dresid_.data(),
                                    moe_weights(P, o, lp_, params_lp_.data()),
                                    moe_weights(grads, o), moe_weight);
    } else {
      const int64_t Fd = cfg_.dense_ffn_hidden();
      linear_bwd(dg_.data(), false, grads + o.mlp_w2, dresid_.data(), a.g.data(), a.g_lp.data(),
                 o.mlp_w2, Fd, C);
      swiglu_backward(dh1_.data(), dh3_.data(), dg_.data(), a.h1.data(), a.h3.data(), N * Fd);
      linear_bwd(dln_.data(), false, grads + o.mlp_w1, dh1_.data(), a.ln2.data(), a.ln2_lp.data(),
                 o.mlp_w1, C, Fd);
      linear_bwd(dln_.data(), true, grads + o.mlp_w3, dh3_.data(), a.ln2.data(), a.ln2_lp.data(),
                 o.mlp_w3, C, Fd);
    }
    rmsnorm_backward(dxmid_.data(), grads + o.ln2, dln_.data(), a.xmid.data(), params + o.ln2,
                     a.rstd2.data(), N, C);
    for (int64_t i = 0; i < N * C; ++i) dxmid_[i] += dresid_[i];

    linear_bwd(datt_.data(), false, grads + o.wo, dxmid_.data(), a.att.data(), a.att_lp.data(),
               o.wo, QD, C);
    (bf16_attention(T) ? attention_backward_bf16 : attention_backward)(
        dq_.data(), dk_.data(), dv_.data(), datt_.data(), a.q.data(), a.k.data(), a.v.data(),
        a.att.data(), a.lse.data(), B, T, NH, NKV, HS);
    rope_backward(dq_.data(), dq_.data(), pos_.data(), N, NH, HS, theta);
    rope_backward(dk_.data(), dk_.data(), pos_.data(), N, NKV, HS, theta);
    linear_bwd(dln_.data(), false, grads + o.wq, dq_.data(), a.ln1.data(), a.ln1_lp.data(), o.wq, C,
               QD);
    linear_bwd(dln_.data(), true, grads + o.wk, dk_.data(), a.ln1.data(), a.ln1_lp.data(), o.wk, C,
               KD);
    linear_bwd(dln_.data(), true, grads + o.wv, dv_.data(), a.ln1.data(), a.ln1_lp.data(), o.wv, C,
               KD);
    rmsnorm_backward(dresid_.data(), grads + o.ln1, dln_.data(), x, params + o.ln1, a.rstd1.data(),
                     N, C);
    for (int64_t i = 0; i < N * C; ++i) dresid_[i] += dxmid_[i];
    if (grads_ready_) grads_ready_(o.ln1);  // the block's first tensor
  }
  embedding_backward(grads + layout_.embed, dresid_.data(), inputs_.data(), N, C, V);
  if (grads_ready_) grads_ready_(0);
}

double Transformer::flops_per_token(int64_t T) const {
  // Active parameters per token: everything but the unused experts and the embedding table
  // (a lookup, not a matmul).
  const int64_t C = cfg_.dim, HS = cfg_.head_dim();
  double active = 0;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    active += double(C) * HS * (2 * cfg_.n_heads + 2 * cfg_.n_kv_heads);
    if (cfg_.is_dense_layer(l)) {
      active += 3.0 * C * cfg_.dense_ffn_hidden();
    } else {
      active += double(C) * cfg_.n_experts + 3.0 * C * cfg_.expert_hidden * cfg_.top_k;
      active += 3.0 * C * cfg_.shared_expert_hidden;
    }
  }
  active += double(C) * cfg_.vocab_size;
  // Causal attention: QKᵀ and PV each 2·T/2·HS per head per token forward, ×3 with backward.
  double attn = cfg_.n_layers * 3.0 * 2.0 * 2.0 * (T / 2.0) * HS * cfg_.n_heads;
  return 6.0 * active + attn;
}

}  // namespace moetrain
