// Transformer::decode: one token through the model against a KV cache, the per-token form of
// Transformer::forward (same kernels where one token allows, attention_decode for attention).
#include <algorithm>

#include "core/check.h"
#include "kernels/attention.h"
#include "kernels/rope.h"
#include "model/transformer.h"

namespace moetrain {

const float* Transformer::decode(const float* params, int32_t token, KvCache& cache) {
  MOETRAIN_CHECK(!on_device(), "decode: decoding runs on the CPU (set_device(\"cpu\") first)");
  MOETRAIN_CHECK(!units_, "decode: decoding reads whole parameters, not sharded ones (dist.zero = 3)");
  MOETRAIN_CHECK(first_ == 0 && last_stage(),
                 "decode: decoding runs the whole model, not a pipeline stage");
  MOETRAIN_CHECK(!tp_, "decode: decoding runs on one process, not under tensor parallelism");
  MOETRAIN_CHECK(static_cast<int64_t>(cache.k.size()) == cfg_.n_layers,
                 "decode: the KV cache has {} layers, the model {}", cache.k.size(),
                 cfg_.n_layers);
  MOETRAIN_CHECK(cache.length < cache.capacity,
                 "decode: the KV cache is full ({} positions); prefill a shorter window first",
                 cache.capacity);
  MOETRAIN_CHECK(token >= 0 && token < cfg_.vocab_size,
                 "decode: token {} outside the vocabulary [0, {})", token, cfg_.vocab_size);
  const int64_t C = cfg_.dim, V = cfg_.vocab_size, HS = cfg_.head_dim();
  const int64_t NH = cfg_.n_heads, NKV = cfg_.n_kv_heads, QD = NH * HS, KD = NKV * HS;
  const int64_t Fd = cfg_.dense_every > 0 ? cfg_.dense_ffn_hidden() : 0;
  const float eps = static_cast<float>(cfg_.norm_eps), theta = static_cast<float>(cfg_.rope_theta);
  auto sz = [](int64_t n) { return static_cast<std::size_t>(n); };
  dx_.resize(sz(C)), dln_tok_.resize(sz(C)), dmid_.resize(sz(C)), dffn_.resize(sz(C));
  dq_tok_.resize(sz(QD)), datt_tok_.resize(sz(QD)), dk_tok_.resize(sz(KD)), dv_tok_.resize(sz(KD));
  dh1_tok_.resize(sz(Fd)), dh3_tok_.resize(sz(Fd)), dg_tok_.resize(sz(Fd));
  dlogits_tok_.resize(sz(V));
  // The CPU's operations, as forward's: the GEMMs from inp rounded in mixed precision.
  CpuOps& op = *cpu_;
  refresh_lp_weights(params);
  op.bind_params(params);
  auto linear = [&](float* out, const float* inp, int64_t w, int64_t IC, int64_t OC) {
    op.linear_forward(out, inp, op.round(dlp_, inp, IC), w, 1, IC, OC, 0);
  };

  const int64_t t = cache.length;
  const int32_t pos = static_cast<int32_t>(t);
  op.embedding_forward(dx_.data(), &token, params + layout_.embed, 1, C, V);
  float rstd = 0;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const LayerOffsets& o = layout_.layers[l];
    float* kc = cache.k[l].data();
    float* vc = cache.v[l].data();
    op.rmsnorm_forward(dln_tok_.data(), &rstd, dx_.data(), params + o.ln1, 1, C, eps);
    linear(dq_tok_.data(), dln_tok_.data(), o.wq, C, QD);
    linear(kc + t * KD, dln_tok_.data(), o.wk, C, KD);
    linear(vc + t * KD, dln_tok_.data(), o.wv, C, KD);
    rope_forward(dq_tok_.data(), dq_tok_.data(), &pos, 1, NH, HS, theta);
    rope_forward(kc + t * KD, kc + t * KD, &pos, 1, NKV, HS, theta);
    attention_decode(datt_tok_.data(), dq_tok_.data(), kc, vc, t + 1, NH, NKV, HS);
    cache.keys_attended += t + 1;
    cache.max_keys = std::max(cache.max_keys, t + 1);
    linear(dmid_.data(), datt_tok_.data(), o.wo, QD, C);
    for (int64_t i = 0; i < C; ++i) dmid_[i] += dx_[i];
    op.rmsnorm_forward(dln_tok_.data(), &rstd, dmid_.data(), params + o.ln2, 1, C, eps);
    if (moe_index_[l] >= 0) {
      MoeStep s;
      s.training = false;
      s.layer = static_cast<uint64_t>(l);
      op.moe_forward(*moe_[moe_index_[l]], l, dffn_.data(), dln_tok_.data(), 1, o, s, false);
    } else {
      linear(dh1_tok_.data(), dln_tok_.data(), o.mlp_w1, C, Fd);
      linear(dh3_tok_.data(), dln_tok_.data(), o.mlp_w3, C, Fd);
      op.swiglu_forward(dg_tok_.data(), dh1_tok_.data(), dh3_tok_.data(), Fd);
      linear(dffn_.data(), dg_tok_.data(), o.mlp_w2, Fd, C);
    }
    for (int64_t i = 0; i < C; ++i) dx_[i] = dmid_[i] + dffn_[i];
  }
  op.rmsnorm_forward(dln_tok_.data(), &rstd, dx_.data(), params + layout_.final_norm, 1, C, eps);
  linear(dlogits_tok_.data(), dln_tok_.data(), layout_.lm_head, C, V);
  cache.length = t + 1;
  return dlogits_tok_.data();
}

}  // namespace moetrain
