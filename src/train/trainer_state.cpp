// The LM trainer's run state: trainer_state.json and its restore, the checkpoint documents and
// shares, loading a checkpoint to resume or to use the model.
#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "core/log.h"
#include "data/shard.h"
#include "io/hf_checkpoint.h"
#include "parallel/sharded_optimizer.h"
#include "train/run_state.h"
#include "train/step_update.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace moetrain {

namespace {

// The parameters of a Hugging Face directory into `params` (sized to the model's layout).
void read_hf_weights(const fs::path& dir, Transformer& model, std::vector<float>& params) {
  params.assign(static_cast<std::size_t>(model.layout().size()), 0.0f);
  read_hf_tensors(dir, model_views(model.layout(), params.data()));
}

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

LoadedModel load_model(const fs::path& dir) {
  LoadedModel out;
  if (is_hf_model_dir(dir)) {
    out.config.model = hf_model_config(dir);
    out.config.train.seq_len = std::min(out.config.train.seq_len, out.config.model.max_seq_len);
    out.model = std::make_unique<Transformer>(out.config.model);
    read_hf_weights(dir, *out.model, out.params);
    // Nothing records the context a Hugging Face model was trained on but its position limit.
    out.trained_context = out.config.model.max_seq_len;
    log_info("loaded Hugging Face model {}", dir.string());
    return out;
  }
  const fs::path ckpt = resolve_checkpoint(dir);
  bool has_seq_len = false;
  out.config = checkpoint_run_config(ckpt, &has_seq_len);
  out.model = std::make_unique<Transformer>(out.config.model);
  out.step = read_weights(ckpt, *out.model, out.params);
  if (has_seq_len) {
    out.trained_context = out.config.train.seq_len;
  } else {
    out.trained_context = out.config.model.max_seq_len;
    log_info("{}/config.json records no train.seq_len: taking model.max_seq_len = {} as the "
             "trained context", ckpt.string(), out.trained_context);
  }
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
    log_info("model.{} = {} from {} (the configuration said {})", key, theirs, where, mine);
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

void Trainer::init_weights_from(const fs::path& dir) {
  if (resumed_) {
    log_info("resumed at step {}: the checkpoint's weights, not those of {}", step_,
             dir.string());
    return;
  }
  MOETRAIN_CHECK(step_ == 0, "--init-from {}: the run is at step {}, not 0", dir.string(), step_);
  if (is_hf_model_dir(dir)) {
    read_hf_weights(dir, *model_, params_);
  } else {
    read_weights(resolve_checkpoint(dir), *model_, params_);
  }
  model_->weights_changed();  // the low-precision weight copies follow the loaded weights
  device_current_ = false;
  log_info("initial weights from {}", dir.string());
}

CheckpointShare Trainer::checkpoint_share(bool reading) {
  const bool sharded = world_size() > 1 && cfg_.dist.zero == 1;
  CheckpointShare share =
      moetrain::checkpoint_share(model_->layout(), params_.data(), *optimizer_, writers_,
                                 expert_shard_, rank(), sharded, bias_views(*model_), reading);
  if (!reading || read_carried_) add_carried_state(share, *reducer_, rank(), world_size());
  return share;
}

nlohmann::json Trainer::trainer_state() const {
  const int64_t B = cfg_.train.batch_size, A = cfg_.train.grad_accum, W = world_size();
  nlohmann::json t = {
      {"step", step_},
      {"config_hash", cfg_.config_hash()},
      {"precision", cfg_.train.precision},
      {"seed", cfg_.train.seed},
      {"optimizer", {{"name", cfg_.optim.name}, {"step_count", optimizer_->step_count()}}},
      {"schedule",
       {{"position", step_}, {"total_steps", cfg_.train.steps}, {"next_lr", schedule_->lr(step_)}}},
      // Batches are a pure function of (seed, step, row of the global batch): the next step and
      // the global batch say where the data stands, whatever the layout.
      {"data",
       {{"next_step", step_},
        {"global_batch", B * A * W},
        {"batch_size", B},
        {"seq_len", cfg_.train.seq_len},
        {"train_tokens", train_shard_->size()}}},
      // Every random stream is counter-based (seed, step, purpose): the seed and the step are
      // the whole generator state.
      {"rng", {{"seed", cfg_.train.seed}, {"next_step", step_}}},
      {"layout",
       {{"processes", W},
        {"ep", pg_->layout.ep},
        {"dp", pg_->layout.dp},
        {"zero", cfg_.dist.zero},
        {"grad_accum", A}}}};
  if (nlohmann::json r = carried_state_record(*reducer_, world_size()); !r.is_null())
    t["grad_residual"] = r;
  if (scaler_) {
    t["loss_scale"] = {{"scale", scaler_->raw_scale()},
                       {"good_steps", scaler_->good_steps()},
                       {"skipped_steps", scaler_->skipped_steps()}};
  }
  if (!capacity_.empty()) {
    nlohmann::json c = nlohmann::json::array();
    for (const CapacityController& k : capacity_) c.push_back(k.to_json());
    t["capacity_controller"] = c;
  }
  if (!gating_.empty()) {
    nlohmann::json g = nlohmann::json::array();
    for (const GatingController& k : gating_) g.push_back(k.to_json());
    t["gating_controller"] = g;
  }
  if (reweight_) t["expert_reweight"] = reweight_->to_json();
  return t;
}

CheckpointDocs Trainer::checkpoint_docs() const {
  nlohmann::json hf = cfg_.model.to_hf_json();
  if (std::string why; !cfg_.model.hf_mixtral_compatible(&why)) {
    // Claiming Mixtral would let transformers load this model and compute something else (drop
    // the shared expert or dense layers with a mere warning, route differently): name our own
    // architecture and type so that AutoModel refuses it, and say why in the file itself.
    hf["architectures"] = {"MoetrainForCausalLM"};
    hf["model_type"] = "moetrain";
    hf["moetrain_note"] = fmt::format("not loadable as transformers' MixtralForCausalLM: {}", why);
  }
  hf["moetrain"] = cfg_.to_json();
  return {hf, trainer_state()};
}

fs::path Trainer::save_checkpoint() {
  // Local steps: a checkpoint holds one model (train.checkpoint_every is a multiple of
  // dist.sync_every, so only a stop between averagings averages early).
  average_replicas();
  // A resident engine holds the current parameters and moments: the host copies catch up.
  if (engine_ && device_current_) device_state_to_host(*engine_, *optimizer_, params_.data());
  // Every rank writes its own pieces; the checkpoint is complete when any rank returns.
  return write_checkpoint(*pg_->control, cfg_.train.run_dir, step_, checkpoint_share(false),
                          checkpoint_docs(), cfg_.train.keep_checkpoints);
}

void Trainer::restore_trainer_state(const nlohmann::json& t, const fs::path& dir) {
  const std::string where = (dir / "trainer_state.json").string();
  auto need = [&](const nlohmann::json& j, const char* key) -> const nlohmann::json& {
    MOETRAIN_CHECK(j.is_object() && j.contains(key), "{}: no '{}'", where, key);
    return j.at(key);
  };
  if (auto_precision_ && t.contains("precision") && t["precision"].is_string() &&
      t["precision"].get<std::string>() != cfg_.train.precision) {
    // The run keeps the precision it started with, wherever it resumes.
    const std::string used = t["precision"].get<std::string>();
    log_info("train.precision = auto: resuming in {} as the run was trained ({} here)", used,
             cfg_.train.precision);
    cfg_.train.precision = used;
    model_->set_precision(cfg_.train.precision_dtype());
    if (cfg_.train.precision_dtype() == DType::F16 && !scaler_)
      scaler_ = std::make_unique<LossScaler>(cfg_.train.loss_scale());
  }
  const std::string hash = need(t, "config_hash").get<std::string>();
  MOETRAIN_CHECK(hash == cfg_.config_hash(),
                 "{} was written with a different configuration (hash {} vs this run's {}): resume "
                 "with the same model, optimizer and batch settings, or use a new train.run_dir",
                 dir.string(), hash, cfg_.config_hash());
  step_ = need(t, "step").get<int64_t>();
  read_carried_ = carried_state_matches(t, *reducer_, world_size());
  optimizer_->set_step_count(need(need(t, "optimizer"), "step_count").get<int64_t>());
  if (scaler_ && t.contains("loss_scale")) {
    const nlohmann::json& ls = t["loss_scale"];
    scaler_->restore(ls.value("scale", 1.0), ls.value("good_steps", int64_t{0}),
                     ls.value("skipped_steps", int64_t{0}));
  }

  if (!capacity_.empty()) {
    const nlohmann::json& c = need(t, "capacity_controller");
    MOETRAIN_CHECK(c.is_array() && c.size() == capacity_.size(),
                   "{}: 'capacity_controller' must hold one state per MoE layer ({})", where,
                   capacity_.size());
    for (std::size_t m = 0; m < capacity_.size(); ++m) capacity_[m].restore(c[m], where);
    apply_capacity_factors(capacity_, model_->moe_layers());
  }
  if (!gating_.empty()) {
    const nlohmann::json& g = need(t, "gating_controller");
    MOETRAIN_CHECK(g.is_array() && g.size() == gating_.size(),
                   "{}: 'gating_controller' must hold one state per MoE layer ({})", where,
                   gating_.size());
    for (std::size_t m = 0; m < gating_.size(); ++m) gating_[m].restore(g[m], where);
  }
  if (reweight_) reweight_->restore(need(t, "expert_reweight"), where);

  // The global batch stays what it was: a different number of processes changes the number of
  // micro-batches per step (the windows of a step do not depend on how they are split).
  const nlohmann::json& data = need(t, "data");
  const int64_t global = need(data, "global_batch").get<int64_t>();
  const int64_t per_micro = cfg_.train.batch_size * world_size();
  MOETRAIN_CHECK(global > 0 && global % per_micro == 0,
                 "{} was trained with a global batch of {} sequences per step; {} processes x "
                 "train.batch_size {} = {} sequences per micro-batch do not divide it: resume on a "
                 "process count that does",
                 dir.string(), global, world_size(), cfg_.train.batch_size, per_micro);
  if (global / per_micro != cfg_.train.grad_accum)
    log_info(
        "train.grad_accum = {} instead of {}: {} processes keep the global batch of {} "
        "sequences per step",
        global / per_micro, cfg_.train.grad_accum, world_size(), global);
  cfg_.train.grad_accum = global / per_micro;
  if (data.value("train_tokens", uint64_t{0}) != train_shard_->size())
    log_warn("{}: the training data had {} tokens, {} has {}: batches will differ", where,
             data.value("train_tokens", uint64_t{0}), train_shard_->path().string(),
             train_shard_->size());
}

void Trainer::load_checkpoint(const fs::path& dir) {
  device_current_ = false;
  reading_json(dir / "trainer_state.json", [&] {
    restore_trainer_state(read_checkpoint_json(dir, "trainer_state.json"), dir);
  });
  // Each rank reads the ranges it holds, from whichever files hold them.
  read_checkpoint_pieces(dir, checkpoint_share(true));
  model_->weights_changed();
  averaged_at_ = step_;  // a checkpoint holds averaged parameters  // the low-precision weight copies follow the loaded weights
}

void Trainer::check_ranks_agree() {
  // The data's sizes: the same data.dir may hold different files on different machines.
  const nlohmann::json data = {{"data.train_tokens", train_shard_->size()},
                               {"data.val_tokens", val_shard_->size()}};
  moetrain::check_ranks_agree(*pg_->control, rank_settings(cfg_.to_json(), data),
                              std::stoull(cfg_.config_hash(), nullptr, 16), step_);
}

}  // namespace moetrain
