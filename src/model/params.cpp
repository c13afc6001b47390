#include "model/params.h"

#include <cmath>

#include "core/check.h"
#include "core/rng.h"

namespace moetrain {

int64_t ParamTable::add(std::string name, Shape shape, bool decay, int64_t expert) {
  // 16-float (64-byte) alignment for every tensor: GEMM operands start on a cache line.
  size_ = (size_ + 15) / 16 * 16;
  ParamInfo p{std::move(name), shape, size_, shape_numel(shape), decay, expert};
  size_ += p.numel;
  params_.push_back(std::move(p));
  return params_.back().offset;
}

// Experts are one (E, ...) block so the grouped GEMM strides over them; each expert is still
// listed under its own Hugging Face name as a view into that block.
int64_t ParamTable::add_experts(const std::string& prefix, const char* which, int64_t E,
                                Shape per_expert) {
  size_ = (size_ + 15) / 16 * 16;
  int64_t base = size_;
  int64_t each = shape_numel(per_expert);
  for (int64_t j = 0; j < E; ++j) {
    params_.push_back({fmt::format("{}.experts.{}.{}.weight", prefix, j, which), per_expert,
                       base + j * each, each, true, j});
  }
  size_ = base + E * each;
  return base;
}

MoeBlockOffsets ParamTable::add_moe_block(const std::string& prefix, const MoeConfig& m) {
  const int64_t C = m.C, E = m.E, F = m.F, Fs = m.shared_F;
  MoeBlockOffsets o;
  // The router is a parameter like any other; decaying it would pull routing towards uniform.
  o.gate = add(prefix + ".gate.weight", {E, C}, false);
  if (m.router == RouterKind::NoisyTopK) o.noise = add(prefix + ".noise.weight", {E, C}, false);
  o.w1 = add_experts(prefix, "w1", E, {F, C});
  o.w3 = add_experts(prefix, "w3", E, {F, C});
  o.w2 = add_experts(prefix, "w2", E, {C, F});
  if (Fs > 0) {
    o.shared_w1 = add(prefix + ".shared_expert.gate_proj.weight", {Fs, C}, true);
    o.shared_w3 = add(prefix + ".shared_expert.up_proj.weight", {Fs, C}, true);
    o.shared_w2 = add(prefix + ".shared_expert.down_proj.weight", {C, Fs}, true);
  }
  return o;
}

MoeWeights moe_weights(float* base, const MoeBlockOffsets& o, DType lp, const void* lp_base) {
  auto at = [base](int64_t off) { return off < 0 ? nullptr : base + off; };
  MoeWeights w;
  w.gate = at(o.gate), w.noise = at(o.noise);
  w.w1 = at(o.w1), w.w3 = at(o.w3), w.w2 = at(o.w2);
  w.shared_w1 = at(o.shared_w1), w.shared_w3 = at(o.shared_w3), w.shared_w2 = at(o.shared_w2);
  if (lp == DType::F32) return w;
  auto lp_at = [lp_base](int64_t off) -> const void* {
    return off < 0 ? nullptr : static_cast<const char*>(lp_base) + off * 2;
  };
  w.lp = lp;
  w.w1_lp = lp_at(o.w1), w.w3_lp = lp_at(o.w3), w.w2_lp = lp_at(o.w2);
  w.shared_w1_lp = lp_at(o.shared_w1), w.shared_w3_lp = lp_at(o.shared_w3);
  w.shared_w2_lp = lp_at(o.shared_w2);
  return w;
}

void ParamTable::finish() {
  size_ = (size_ + 15) / 16 * 16;
}

ParamLayout::ParamLayout(const ModelConfig& cfg) {
  cfg.validate();
  cfg.check_trainable();
  const int64_t C = cfg.dim, V = cfg.vocab_size, HS = cfg.head_dim();
  embed = add("model.embed_tokens.weight", {V, C}, true);
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    std::string p = fmt::format("model.layers.{}", l);
    LayerOffsets o;
    o.ln1 = add(p + ".input_layernorm.weight", {C}, false);
    o.wq = add(p + ".self_attn.q_proj.weight", {cfg.n_heads * HS, C}, true);
    o.wk = add(p + ".self_attn.k_proj.weight", {cfg.n_kv_heads * HS, C}, true);
    o.wv = add(p + ".self_attn.v_proj.weight", {cfg.n_kv_heads * HS, C}, true);
    o.wo = add(p + ".self_attn.o_proj.weight", {C, cfg.n_heads * HS}, true);
    o.ln2 = add(p + ".post_attention_layernorm.weight", {C}, false);
    if (cfg.is_dense_layer(l)) {
      const int64_t Fd = cfg.dense_ffn_hidden();
      o.mlp_w1 = add(p + ".mlp.gate_proj.weight", {Fd, C}, true);
      o.mlp_w3 = add(p + ".mlp.up_proj.weight", {Fd, C}, true);
      o.mlp_w2 = add(p + ".mlp.down_proj.weight", {C, Fd}, true);
    } else {
      static_cast<MoeBlockOffsets&>(o) = add_moe_block(p + ".block_sparse_moe", cfg.moe());
    }
    layers.push_back(o);
  }
  final_norm = add("model.norm.weight", {C}, false);
  lm_head = add("lm_head.weight", {V, C}, true);
  finish();
}

const ParamInfo* ParamTable::find_or_null(const std::string& name) const {
  for (const auto& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

const ParamInfo& ParamTable::find(const std::string& name) const {
  const ParamInfo* p = find_or_null(name);
  MOETRAIN_CHECK(p != nullptr, "no parameter named '{}' in this model", name);
  return *p;
}

void init_table_params(float* params, const ParamTable& table, double init_std, int64_t n_layers,
                       uint64_t seed, int64_t tensors_from, int64_t tensors_to) {
  const float std_dev = static_cast<float>(init_std);
  const float out_std = std_dev / std::sqrt(2.0f * static_cast<float>(n_layers));
  for (std::size_t i = 0; i < table.params().size(); ++i) {
    const ParamInfo& p = table.params()[i];
    if (p.offset < tensors_from || p.offset >= tensors_to) continue;
    float* dst = params + p.offset;
    if (p.shape.size() == 1) {
      const float v = p.name.ends_with(".bias") ? 0.0f : 1.0f;
      for (int64_t j = 0; j < p.numel; ++j) dst[j] = v;
      continue;
    }
    // Residual-branch outputs start small so the stream is dominated by its input at first.
    bool is_output = p.name.ends_with("o_proj.weight") || p.name.ends_with(".w2.weight") ||
                     p.name.ends_with("down_proj.weight");
    // One stream per tensor (by its index in the table): adding a tensor never reshuffles others.
    Rng rng(seed, rng_stream(RngPurpose::Init, i, 0));
    rng_fill_normal(dst, p.numel, rng, 0.0f, is_output ? out_std : std_dev);
  }
}

void init_params(float* params, const ParamLayout& layout, const ModelConfig& cfg, uint64_t seed,
                 int64_t tensors_from, int64_t tensors_to) {
  init_table_params(params, layout, cfg.init_std, cfg.n_layers, seed, tensors_from, tensors_to);
}

}  // namespace moetrain
