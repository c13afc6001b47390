#include "model/config.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace moetrain {

int64_t ModelConfig::n_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < n_layers; ++l) n += !is_dense_layer(l);
  return n;
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
  MOETRAIN_CHECK(dim % n_heads == 0, "model.n_heads = {}: must divide model.dim = {}", n_heads,
                 dim);
  MOETRAIN_CHECK(n_heads % n_kv_heads == 0, "model.n_kv_heads = {}: must divide model.n_heads = {}",
                 n_kv_heads, n_heads);
  MOETRAIN_CHECK(head_dim() % 2 == 0,
                 "model.dim / model.n_heads = {}: the head size must be even for RoPE", head_dim());
  MOETRAIN_CHECK(dense_every >= 0, "model.dense_every = {}: must be ≥ 0 (0 = every layer is MoE)",
                 dense_every);
  MOETRAIN_CHECK(dense_hidden >= 0, "model.dense_hidden = {}: must be ≥ 0", dense_hidden);
  MOETRAIN_CHECK(rope_theta > 0, "model.rope_theta = {}: must be positive", rope_theta);
  MOETRAIN_CHECK(norm_eps > 0, "model.norm_eps = {}: must be positive", norm_eps);
  MOETRAIN_CHECK(init_std > 0, "model.init_std = {}: must be positive", init_std);
  validate_moe();
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
