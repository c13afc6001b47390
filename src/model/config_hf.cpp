// transformers' MixtralConfig read into a ModelConfig (to_hf_json, in config.cpp, writes it).
#include <fmt/format.h>

#include <cmath>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "model/config.h"

namespace moetrain {

namespace {

using json = nlohmann::json;

bool absent(const json& hf, const char* key) {
  return !hf.contains(key) || hf[key].is_null();
}

int64_t int_field(const json& hf, const char* key, const std::string& where,
                  std::optional<int64_t> dflt = std::nullopt) {
  if (absent(hf, key)) {
    MOETRAIN_CHECK(dflt.has_value(), "{}: no '{}' (a MixtralConfig field moetrain needs)", where,
                   key);
    return *dflt;
  }
  const json& v = hf[key];
  MOETRAIN_CHECK(v.is_number_integer(), "{}: {} = {}: must be an integer", where, key, v.dump());
  const int64_t x = v.get<int64_t>();
  MOETRAIN_CHECK(x > 0, "{}: {} = {}: must be positive", where, key, x);
  return x;
}

double real_field(const json& hf, const char* key, const std::string& where, double dflt) {
  if (absent(hf, key)) return dflt;
  const json& v = hf[key];
  MOETRAIN_CHECK(v.is_number() && std::isfinite(v.get<double>()),
                 "{}: {} = {}: must be a finite number", where, key, v.dump());
  return v.get<double>();
}

}  // namespace

ModelConfig ModelConfig::from_hf_json(const json& hf, const std::string& where) {
  MOETRAIN_CHECK(hf.is_object(), "{}: not a JSON object", where);
  if (!absent(hf, "model_type"))
    MOETRAIN_CHECK(hf["model_type"] == "mixtral",
                   "{}: model_type = {}: only Mixtral ('mixtral') checkpoints load", where,
                   hf["model_type"].dump());
  ModelConfig c;
  c.vocab_size = int_field(hf, "vocab_size", where);
  c.dim = int_field(hf, "hidden_size", where);
  c.expert_hidden = int_field(hf, "intermediate_size", where);
  c.n_layers = int_field(hf, "num_hidden_layers", where);
  c.n_heads = int_field(hf, "num_attention_heads", where);
  // MixtralConfig's own rule: no num_key_value_heads means one KV head per query head.
  c.n_kv_heads = int_field(hf, "num_key_value_heads", where, c.n_heads);
  c.n_experts = int_field(hf, "num_local_experts", where);
  c.top_k = int_field(hf, "num_experts_per_tok", where);
  c.max_seq_len = int_field(hf, "max_position_embeddings", where, 4096 * 32);
  c.rope_theta = real_field(hf, "rope_theta", where, 1e6);
  c.norm_eps = real_field(hf, "rms_norm_eps", where, 1e-5);
  c.init_std = real_field(hf, "initializer_range", where, 0.02);
  c.aux_loss_coef = real_field(hf, "router_aux_loss_coef", where, 0.001);
  c.z_loss_coef = 0.0;
  c.router = RouterKind::TopKSoftmax;
  c.renormalize = true;
  c.capacity_factor = 0.0;
  c.shared_expert_hidden = 0;
  c.dense_every = 0;

  MOETRAIN_CHECK(c.dim % c.n_heads == 0,
                 "{}: num_attention_heads = {} does not divide hidden_size = {}: moetrain's head "
                 "size is hidden_size / num_attention_heads",
                 where, c.n_heads, c.dim);
  if (!absent(hf, "head_dim"))
    MOETRAIN_CHECK(hf["head_dim"].is_number_integer() && hf["head_dim"] == c.head_dim(),
                   "{}: head_dim = {}: moetrain's head size is hidden_size / num_attention_heads "
                   "= {}",
                   where, hf["head_dim"].dump(), c.head_dim());
  if (!absent(hf, "hidden_act"))
    MOETRAIN_CHECK(hf["hidden_act"] == "silu",
                   "{}: hidden_act = {}: moetrain's experts are SwiGLU, 'silu' only", where,
                   hf["hidden_act"].dump());
  if (!absent(hf, "sliding_window")) {
    const json& w = hf["sliding_window"];
    MOETRAIN_CHECK(w.is_number_integer() && w.get<int64_t>() >= c.max_seq_len,
                   "{}: sliding_window = {}: moetrain attends over the whole context, so it must "
                   "be null or ≥ max_position_embeddings = {}",
                   where, w.dump(), c.max_seq_len);
  }
  if (!absent(hf, "tie_word_embeddings"))
    MOETRAIN_CHECK(hf["tie_word_embeddings"] == false,
                   "{}: tie_word_embeddings = {}: moetrain keeps lm_head.weight separate from "
                   "the embedding",
                   where, hf["tie_word_embeddings"].dump());
  MOETRAIN_CHECK(absent(hf, "rope_scaling"), "{}: rope_scaling = {}: moetrain's RoPE is unscaled",
                 where, hf.contains("rope_scaling") ? hf["rope_scaling"].dump() : "");
  MOETRAIN_CHECK(absent(hf, "quantization_config"),
                 "{}: quantization_config is set: quantized weights do not load, only "
                 "F32/BF16/F16 ones",
                 where);
  for (const char* key : {"attention_dropout", "router_jitter_noise"})
    MOETRAIN_CHECK(real_field(hf, key, where, 0.0) == 0.0,
                   "{}: {} = {}: moetrain has no such noise, it must be 0", where, key,
                   hf[key].dump());
  try {
    c.validate();
  } catch (const Error& e) {
    MOETRAIN_FAIL("{}: {} (mapped from the MixtralConfig fields)", where, e.what());
  }
  return c;
}

}  // namespace moetrain
