#include "model/config.h"

#include <fmt/format.h>

#include <cmath>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace moetrain {

int64_t ModelConfig::n_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < n_layers; ++l) n += !is_dense_layer(l);
  return n;
}

int64_t ModelConfig::attention_params() const {
  const int64_t C = dim, NH = n_heads;
  if (!mla()) return (2 * NH + 2 * n_kv_heads) * head_dim() * C;
  const int64_t qk = qk_head_dim();
  // q: W_qa (q_lora_rank, C), its norm, W_qb (NH·qk, q_lora_rank); or W_q (NH·qk, C).
  const int64_t q = q_lora_rank > 0 ? q_lora_rank * C + q_lora_rank + NH * qk * q_lora_rank
                                    : NH * qk * C;
  // W_kva (kv_lora_rank + rope, C), its norm on c_kv, W_kvb (NH·(nope + v), kv_lora_rank).
  const int64_t kv = (kv_lora_rank + qk_rope_head_dim) * C + kv_lora_rank +
                     NH * (qk_nope_head_dim + v_head_dim) * kv_lora_rank;
  return q + kv + NH * v_head_dim * C;  // and W_o (C, NH·v)
}

double ModelConfig::attention_pairs(int64_t layer, int64_t T) const {
  const double t = static_cast<double>(T), w = static_cast<double>(attention_window(layer));
  if (w <= 0 || w >= t) return t * (t + 1) / 2;
  return w * (w + 1) / 2 + (t - w) * w;
}

void ModelConfig::validate() const {
  auto positive = [](const char* key, int64_t v) {
    MOETRAIN_CHECK(v > 0, "model.{} = {}: must be a positive integer", key, v);
  };
  positive("vocab_size", vocab_size);
  positive("dim", dim);
  positive("n_layers", n_layers);
  positive("n_heads", n_heads);
  positive("n_kv_heads", n_kv_heads);
  positive("max_seq_len", max_seq_len);
  MOETRAIN_CHECK(vocab_size <= 2147483647,
                 "model.vocab_size = {}: token ids are int32, so at most 2147483647", vocab_size);
  MOETRAIN_CHECK(head_size >= 0, "model.head_dim = {}: must be ≥ 0 (0 = model.dim / model.n_heads)",
                 head_size);
  if (head_size == 0)
    MOETRAIN_CHECK(dim % n_heads == 0,
                   "model.n_heads = {}: must divide model.dim = {} (or set model.head_dim)", n_heads,
                   dim);
  MOETRAIN_CHECK(n_heads % n_kv_heads == 0, "model.n_kv_heads = {}: must divide model.n_heads = {}",
                 n_kv_heads, n_heads);
  validate_mla();
  if (head_size > 0)
    MOETRAIN_CHECK(head_size % 2 == 0, "model.head_dim = {}: must be even for RoPE", head_size);
  else if (!mla())
    MOETRAIN_CHECK(head_dim() % 2 == 0,
                   "model.dim / model.n_heads = {}: the head size must be even for RoPE",
                   head_dim());
  MOETRAIN_CHECK(first_dense_layers >= 0 && first_dense_layers <= n_layers,
                 "model.first_dense_layers = {}: must be in [0, model.n_layers = {}]",
                 first_dense_layers, n_layers);
  MOETRAIN_CHECK(sliding_window >= 0, "model.sliding_window = {}: must be ≥ 0 (0 = full attention)",
                 sliding_window);
  MOETRAIN_CHECK(full_attention_every >= 0,
                 "model.full_attention_every = {}: must be ≥ 0 (0 = every block windowed)",
                 full_attention_every);
  MOETRAIN_CHECK(full_attention_every == 0 || sliding_window > 0,
                 "model.full_attention_every = {}: needs model.sliding_window > 0",
                 full_attention_every);
  MOETRAIN_CHECK(dense_every >= 0, "model.dense_every = {}: must be ≥ 0 (0 = every layer is MoE)",
                 dense_every);
  MOETRAIN_CHECK(dense_hidden >= 0, "model.dense_hidden = {}: must be ≥ 0", dense_hidden);
  MOETRAIN_CHECK(rope_theta > 0, "model.rope_theta = {}: must be positive", rope_theta);
  MOETRAIN_CHECK(norm_eps > 0, "model.norm_eps = {}: must be positive", norm_eps);
  MOETRAIN_CHECK(init_std > 0, "model.init_std = {}: must be positive", init_std);
  validate_moe();
}

void ModelConfig::validate_mla() const {
  const std::pair<const char*, int64_t> keys[] = {{"q_lora_rank", q_lora_rank},
                                                  {"kv_lora_rank", kv_lora_rank},
                                                  {"qk_rope_head_dim", qk_rope_head_dim},
                                                  {"qk_nope_head_dim", qk_nope_head_dim},
                                                  {"v_head_dim", v_head_dim}};
  for (const auto& [key, v] : keys) {
    MOETRAIN_CHECK(v >= 0, "model.{} = {}: must be ≥ 0", key, v);
    MOETRAIN_CHECK(v == 0 || mla(),
                   "model.{} = {}: multi-head latent attention needs model.kv_lora_rank > 0", key,
                   v);
  }
  if (!mla()) return;
  MOETRAIN_CHECK(head_size == 0,
                 "model.head_dim = {}: with multi-head latent attention (model.kv_lora_rank = {}) "
                 "the heads' widths are model.qk_nope_head_dim, qk_rope_head_dim and v_head_dim",
                 head_size, kv_lora_rank);
  for (const auto& [key, v] : {keys[2], keys[3], keys[4]})
    MOETRAIN_CHECK(v > 0, "model.{} = {}: must be positive with model.kv_lora_rank = {}", key, v,
                   kv_lora_rank);
  MOETRAIN_CHECK(qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim = {}: must be even for RoPE",
                 qk_rope_head_dim);
}

void ModelConfig::check_trainable() const {
  auto planner_only = [](const char* key, int64_t v, const std::string& what) {
    MOETRAIN_FAIL("model.{} = {}: {}; the key is the planner's only (moetrain plan prices it, "
                  "moetrain train cannot compute it)",
                  key, v, what);
  };
  if (first_dense_layers > 0)
    planner_only("first_dense_layers", first_dense_layers,
                 "the trainer's model places dense blocks with model.dense_every only");
  if (head_size > 0 && (dim % n_heads != 0 || head_size != dim / n_heads))
    planner_only("head_dim", head_size,
                 fmt::format("the trainer's model has heads of model.dim / model.n_heads ({} / {})",
                             dim, n_heads));
  if (sliding_window > 0)
    planner_only("sliding_window", sliding_window,
                 "the trainer's attention is full causal attention");
  if (mla())
    planner_only("kv_lora_rank", kv_lora_rank,
                 "the trainer's model has no multi-head latent attention");
}

bool ModelConfig::hf_mixtral_compatible(std::string* why) const {
  auto no = [why](const char* reason) {
    if (why) *why = reason;
    return false;
  };
  if (router != RouterKind::TopKSoftmax)
    return no("only the topk_softmax router exists in transformers' Mixtral");
  if (!renormalize) return no("Mixtral always renormalises the top-k weights");
  if (shared_expert_hidden > 0) return no("Mixtral has no shared experts");
  if (dense_every > 0) return no("Mixtral has no dense layers");
  if (capacity_factor > 0) return no("Mixtral does not drop tokens (capacity_factor must be 0)");
  if (route_groups > 1) return no("Mixtral has no group-limited routing (route_groups must be 0)");
  if (router_skew != 0) return no("Mixtral has no router skew (router_skew must be 0)");
  return true;
}

}  // namespace moetrain

namespace moetrain {

nlohmann::json ModelConfig::to_hf_json() const {
  return {
      {"architectures", {"MixtralForCausalLM"}},
      {"model_type", "mixtral"},
      {"vocab_size", vocab_size},
      {"hidden_size", dim},
      {"intermediate_size", expert_hidden},
      {"num_hidden_layers", n_layers},
      {"num_attention_heads", n_heads},
      {"num_key_value_heads", n_kv_heads},
      {"head_dim", head_dim()},
      {"hidden_act", "silu"},
      {"max_position_embeddings", max_seq_len},
      {"initializer_range", init_std},
      {"rms_norm_eps", norm_eps},
      {"use_cache", true},
      {"rope_theta", rope_theta},
      {"sliding_window", nullptr},
      {"attention_dropout", 0.0},
      {"num_experts_per_tok", top_k},
      {"num_local_experts", n_experts},
      {"output_router_logits", false},
      {"router_aux_loss_coef", aux_loss_coef},
      {"router_jitter_noise", 0.0},
      {"tie_word_embeddings", false},
      {"torch_dtype", "float32"},
      {"bos_token_id", nullptr},
      {"eos_token_id", nullptr},
  };
}

}  // namespace moetrain
