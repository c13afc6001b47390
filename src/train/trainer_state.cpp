// The LM trainer's run state: trainer_state.json and its restore, the checkpoint documents and
// shares, loading a checkpoint to resume or to use the model.
#include <fmt/format.h>

#include "core/check.h"
#include "core/log.h"
#include "data/shard.h"
#include "parallel/sharded_optimizer.h"
#include "train/run_state.h"
#include "train/step_update.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace moetrain {

LoadedModel load_model(const fs::path& dir) {
  const fs::path ckpt = resolve_checkpoint(dir);
  nlohmann::json config = read_checkpoint_json(ckpt, "config.json");
  MOETRAIN_CHECK(config.contains("moetrain"),
                 "{}/config.json: no 'moetrain' section (not written by moetrain)", ckpt.string());
  LoadedModel out;
  out.config = run_config_from_json(config["moetrain"], (ckpt / "config.json").string());
  out.model = std::make_unique<Transformer>(out.config.model);
  out.step = read_weights(ckpt, *out.model, out.params);
  log_info("loaded {} (step {})", ckpt.string(), out.step);
  return out;
}

CheckpointShare Trainer::checkpoint_share(bool reading) {
  const bool sharded = world_size() > 1 && cfg_.dist.zero == 1;
  return moetrain::checkpoint_share(model_->layout(), params_.data(), *optimizer_, writers_,
                                    expert_shard_, rank(), sharded, bias_views(*model_), reading);
}

nlohmann::json Trainer::trainer_state() const {
  const int64_t B = cfg_.train.batch_size, A = cfg_.train.grad_accum, W = world_size();
  nlohmann::json t = {
      {"step", step_},
      {"config_hash", cfg_.config_hash()},
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
  const std::string hash = need(t, "config_hash").get<std::string>();
  MOETRAIN_CHECK(hash == cfg_.config_hash(),
                 "{} was written with a different configuration (hash {} vs this run's {}): resume "
                 "with the same model, optimizer and batch settings, or use a new train.run_dir",
                 dir.string(), hash, cfg_.config_hash());
  step_ = need(t, "step").get<int64_t>();
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
  reading_json(dir / "trainer_state.json", [&] {
    restore_trainer_state(read_checkpoint_json(dir, "trainer_state.json"), dir);
  });
  // Each rank reads the ranges it holds, from whichever files hold them.
  read_checkpoint_pieces(dir, checkpoint_share(true));
  model_->weights_changed();  // the low-precision weight copies follow the loaded weights
}

void Trainer::check_ranks_agree() {
  // The data's sizes: the same data.dir may hold different files on different machines.
  const nlohmann::json data = {{"data.train_tokens", train_shard_->size()},
                               {"data.val_tokens", val_shard_->size()}};
  moetrain::check_ranks_agree(*pg_->control, rank_settings(cfg_.to_json(), data),
                              std::stoull(cfg_.config_hash(), nullptr, 16), step_);
}

}  // namespace moetrain
