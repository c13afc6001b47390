// The shape of a model. Validated once, when built, with messages that name the key.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "moe/settings.h"

namespace moetrain {

struct ModelConfig : MoeModelConfig {
  int64_t vocab_size = 256;  // V
  int64_t dim = 128;         // C
  int64_t n_layers = 4;      // L
  int64_t n_heads = 4;       // NH
  int64_t n_kv_heads = 2;    // NKV (grouped-query attention)
  int64_t dense_every =
      0;  // every n-th layer (1-based: layers n-1, 2n-1, ...) a dense FFN; 0 = none
  int64_t dense_hidden = 0;  // dense FFN hidden size (0 = expert_hidden · top_k)
  int64_t max_seq_len = 256;
  double rope_theta = 1e6;  // Mixtral's
  double norm_eps = 1e-5;
  double init_std = 0.02;

  int64_t head_dim() const { return dim / n_heads; }  // HS
  bool is_dense_layer(int64_t layer) const {
    return dense_every > 0 && (layer + 1) % dense_every == 0;
  }
  int64_t dense_ffn_hidden() const {
    return dense_hidden > 0 ? dense_hidden : expert_hidden * top_k;
  }
  int64_t n_moe_layers() const;
  // The MoE layer configuration this model uses for its MoE blocks.
  MoeConfig moe() const { return moe_config(dim); }
  // Throws naming the key ("model.n_heads = 3: must divide model.dim = 128") on any invalid value.
  void validate() const;
  // True when a checkpoint of this model loads in transformers' MixtralForCausalLM as is.
  bool hf_mixtral_compatible(std::string* why = nullptr) const;
  // transformers' MixtralConfig fields (config.json of a checkpoint).
  nlohmann::json to_hf_json() const;
  // The inverse, for a config.json that transformers wrote (`where` names it in errors): absent
  // optional fields take MixtralConfig's defaults; a field whose value this model cannot compute
  // (another activation, tied embeddings, a sliding window shorter than the context, RoPE
  // scaling, ...) is refused, naming the field and its value. Mixtral has no z-loss: 0.
  static ModelConfig from_hf_json(const nlohmann::json& hf, const std::string& where);
};

}  // namespace moetrain
