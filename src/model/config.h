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
  // --- shapes the planner prices and the trainer's model does not compute (check_trainable) ---
  int64_t first_dense_layers = 0;  // the first n blocks have a dense FFN (DeepSeek-V3: 3)
  int64_t head_size = 0;           // model.head_dim: HS apart from dim / n_heads (0 = that)
  int64_t sliding_window = 0;      // causal window of W keys per query (0 = full attention)
  // With a window: every n-th block (1-based, as dense_every) keeps full attention (0 = none).
  int64_t full_attention_every = 0;
  // Multi-head latent attention (DeepSeek-V2/V3), on when kv_lora_rank > 0: q = W_qb·norm(W_qa·x)
  // (W_q·x when q_lora_rank = 0), [c_kv, k_rope] = W_kva·x, [k_nope, v] = W_kvb·norm(c_kv), per
  // head a query/key of qk_nope_head_dim + qk_rope_head_dim and a value of v_head_dim.
  int64_t q_lora_rank = 0, kv_lora_rank = 0;
  int64_t qk_rope_head_dim = 0, qk_nope_head_dim = 0, v_head_dim = 0;
  int64_t max_seq_len = 256;
  double rope_theta = 1e6;  // Mixtral's
  double norm_eps = 1e-5;
  double init_std = 0.02;

  int64_t head_dim() const { return head_size > 0 ? head_size : dim / n_heads; }  // HS
  bool mla() const { return kv_lora_rank > 0; }
  // Per head: the width queries and keys meet at (scores), and the values' (outputs).
  int64_t qk_head_dim() const { return mla() ? qk_nope_head_dim + qk_rope_head_dim : head_dim(); }
  int64_t value_head_dim() const { return mla() ? v_head_dim : head_dim(); }
  // Weights of one block's attention projections (no norms but MLA's latent ones).
  int64_t attention_params() const;
  bool is_dense_layer(int64_t layer) const {
    return layer < first_dense_layers || (dense_every > 0 && (layer + 1) % dense_every == 0);
  }
  // Keys a query of block `layer` attends to at most (0: all before it, causal).
  int64_t attention_window(int64_t layer) const {
    if (sliding_window <= 0) return 0;
    return full_attention_every > 0 && (layer + 1) % full_attention_every == 0 ? 0 : sliding_window;
  }
  // Causal (query, key) pairs of a sequence of T tokens in block `layer`: T(T + 1)/2, or with a
  // window W < T, W(W + 1)/2 + (T − W)·W.
  double attention_pairs(int64_t layer, int64_t T) const;
  int64_t dense_ffn_hidden() const {
    return dense_hidden > 0 ? dense_hidden : expert_hidden * top_k;
  }
  int64_t n_moe_layers() const;
  // The MoE layer configuration this model uses for its MoE blocks.
  MoeConfig moe() const { return moe_config(dim); }
  // Throws naming the key ("model.n_heads = 3: must divide model.dim = 128") on any invalid value.
  void validate() const;
  // Throws naming the key when the trainer's model cannot compute this shape (the planner-only
  // keys above); every model the trainer builds passes here (ParamLayout).
  void check_trainable() const;
  void validate_mla() const;
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
