#include "train/lm_checkpoint.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "core/log.h"
#include "data/shard.h"
#include "io/hf_checkpoint.h"
#include "train/memory_estimate.h"
#include "train/run_state.h"

namespace fs = std::filesystem;

namespace moetrain {

void read_hf_weights(const fs::path& dir, Transformer& model, std::vector<float>& params) {
  params.assign(static_cast<std::size_t>(model.layout().size()), 0.0f);
  read_hf_tensors(dir, model_views(model.layout(), params.data()));
}

namespace {

ModelConfig hf_model_config(const fs::path& dir) {
  const fs::path file = dir / "config.json";
  return ModelConfig::from_hf_json(read_checkpoint_json(dir, "config.json"), file.string());
}

// The run configuration a checkpoint records; *has_seq_len says whether it records the trained
// context (train.seq_len). One that records none gets model.max_seq_len in its place: the default
// (128) need not even fit the model.
RunConfig checkpoint_run_config(const fs::path& ckpt, bool* has_seq_len = nullptr) {
  nlohmann::json config = read_checkpoint_json(ckpt, "config.json");
  MOETRAIN_CHECK(config.contains("moetrain"),
                 "{}/config.json: no 'moetrain' section (not written by moetrain)", ckpt.string());
  nlohmann::json& run = config["moetrain"];
  const bool has = run.is_object() && run.contains("train") && run["train"].is_object() &&
                   run["train"].contains("seq_len");
  if (!has && run.is_object() && (!run.contains("train") || run["train"].is_object()) &&
      run.contains("model") && run["model"].is_object() && run["model"].contains("max_seq_len"))
    run["train"]["seq_len"] = run["model"]["max_seq_len"];
  if (has_seq_len) *has_seq_len = has;
  return run_config_from_json(run, (ckpt / "config.json").string());
}

}  // namespace

nlohmann::json lm_checkpoint_config(const RunConfig& cfg) {
  nlohmann::json hf = cfg.model.to_hf_json();
  if (std::string why; !cfg.model.hf_mixtral_compatible(&why)) {
    // Claiming Mixtral would let transformers load this model and compute something else (drop
    // the shared expert or dense layers with a mere warning, route differently): name our own
    // architecture and type so that AutoModel refuses it, and say why in the file itself.
    hf["architectures"] = {"MoetrainForCausalLM"};
    hf["model_type"] = "moetrain";
    hf["moetrain_note"] = fmt::format("not loadable as transformers' MixtralForCausalLM: {}", why);
  }
  hf["moetrain"] = cfg.to_json();
  return hf;
}

namespace {

// Refuses, before anything is allocated, a model that cannot fit here (a config.json of millions
// of experts would otherwise allocate for a while and die of std::bad_alloc).
void check_load_memory(const fs::path& dir, const RunConfig& c, bool hf) {
  const ModelConfig& m = c.model;
  const std::string remedy =
      hf ? fmt::format("{}/config.json describes a model this large (hidden_size = {}, "
                       "intermediate_size = {}, num_local_experts = {}, num_hidden_layers = {}, "
                       "vocab_size = {}); load it where there is more memory",
                       dir.string(), m.dim, m.expert_hidden, m.n_experts, m.n_layers,
                       m.vocab_size)
         : fmt::format("its configuration describes a model this large (model.dim = {}, "
                       "model.expert_hidden = {}, model.n_experts = {}, model.n_layers = {}, "
                       "model.vocab_size = {}); load it where there is more memory",
                       m.dim, m.expert_hidden, m.n_experts, m.n_layers, m.vocab_size);
  check_memory(estimate_inference_memory(m, c.train.batch_size, c.train.seq_len), 1,
               fmt::format("loading {}", dir.string()), remedy);
}

// DIR/tokenizer.model, or bytes; refused if the model cannot take its ids.
Tokenizer checkpoint_tokenizer(const fs::path& dir, const ModelConfig& m) {
  Tokenizer t = Tokenizer::from_dir(dir);
  MOETRAIN_CHECK(t.vocab_size() <= m.vocab_size,
                 "{}: the tokenizer {} has {} tokens, more than the model's vocabulary ({}): the "
                 "tokenizer is not the model's",
                 dir.string(),
                 t.is_bytes() ? std::string("(bytes: no tokenizer.model)")
                              : (dir / kTokenizerFile).string(),
                 t.vocab_size(), m.vocab_size);
  return t;
}

}  // namespace

LoadedModel load_model(const fs::path& dir) {
  LoadedModel out;
  if (is_hf_model_dir(dir)) {
    out.config.model = hf_model_config(dir);
    out.config.train.seq_len = std::min(out.config.train.seq_len, out.config.model.max_seq_len);
    check_load_memory(dir, out.config, true);
    out.model = std::make_unique<Transformer>(out.config.model);
    read_hf_weights(dir, *out.model, out.params);
    // Nothing records the context a Hugging Face model was trained on but its position limit.
    out.trained_context = out.config.model.max_seq_len;
    out.tokenizer = checkpoint_tokenizer(dir, out.config.model);
    log_info("loaded Hugging Face model {}", dir.string());
    return out;
  }
  const fs::path ckpt = resolve_checkpoint(dir);
  bool has_seq_len = false;
  out.config = checkpoint_run_config(ckpt, &has_seq_len);
  check_load_memory(ckpt, out.config, false);
  out.model = std::make_unique<Transformer>(out.config.model);
  out.step = read_weights(ckpt, *out.model, out.params);
  if (has_seq_len) {
    out.trained_context = out.config.train.seq_len;
  } else {
    out.trained_context = out.config.model.max_seq_len;
    log_info("{}/config.json records no train.seq_len: taking model.max_seq_len = {} as the "
             "trained context", ckpt.string(), out.trained_context);
  }
  out.tokenizer = checkpoint_tokenizer(ckpt, out.config.model);
  log_info("loaded {} (step {})", ckpt.string(), out.step);
  return out;
}

ModelConfig model_config_of(const fs::path& dir) {
  if (is_hf_model_dir(dir)) return hf_model_config(dir);
  return checkpoint_run_config(resolve_checkpoint(dir)).model;
}

void adopt_architecture(ModelConfig& model, const ModelConfig& from, const std::string& where) {
  auto take = [&](const char* key, auto& mine, const auto& theirs) {
    if (mine == theirs) return;
    if constexpr (std::is_same_v<std::decay_t<decltype(mine)>, RouterKind>) {
      log_info("model.{} = {} from {} (the configuration said {})", key,
               router_kind_name(theirs), where, router_kind_name(mine));
    } else {
      log_info("model.{} = {} from {} (the configuration said {})", key, theirs, where, mine);
    }
    mine = theirs;
  };
  take("vocab_size", model.vocab_size, from.vocab_size);
  take("dim", model.dim, from.dim);
  take("n_layers", model.n_layers, from.n_layers);
  take("n_heads", model.n_heads, from.n_heads);
  take("n_kv_heads", model.n_kv_heads, from.n_kv_heads);
  take("max_seq_len", model.max_seq_len, from.max_seq_len);
  take("rope_theta", model.rope_theta, from.rope_theta);
  take("norm_eps", model.norm_eps, from.norm_eps);
  take("dense_every", model.dense_every, from.dense_every);
  take("dense_hidden", model.dense_hidden, from.dense_hidden);
  take("expert_hidden", model.expert_hidden, from.expert_hidden);
  take("n_experts", model.n_experts, from.n_experts);
  take("top_k", model.top_k, from.top_k);
  take("router", model.router, from.router);
  take("renormalize", model.renormalize, from.renormalize);
  take("capacity_factor", model.capacity_factor, from.capacity_factor);
  take("shared_expert_hidden", model.shared_expert_hidden, from.shared_expert_hidden);
}

}  // namespace moetrain
