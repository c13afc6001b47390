// The LM trainer's run state: trainer_state.json and its restore, the checkpoint documents, the
// weights of another run or model to start from.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "core/log.h"
#include "data/loader.h"
#include "data/shard.h"
#include "io/hf_checkpoint.h"
#include "train/run_state.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace moetrain {

void Trainer::init_weights_from(const fs::path& dir) {
  const int64_t step = engine_->step_count();
  if (resumed_) {
    log_info("resumed at step {}: the checkpoint's weights, not those of {}", step, dir.string());
    return;
  }
  MOETRAIN_CHECK(step == 0, "--init-from {}: the run is at step {}, not 0", dir.string(), step);
  // The weights learnt their ids from the directory's tokenizer: the data must use the same.
  const fs::path from = is_hf_model_dir(dir) ? dir : resolve_checkpoint(dir);
  const Tokenizer theirs = Tokenizer::from_dir(from);
  MOETRAIN_CHECK(theirs.fingerprint() == tokenizer_.fingerprint(),
                 "--init-from {}: its tokenizer is {} ({}), but data.dir = {} was prepared with {}: "
                 "prepare the data with `moetrain prepare --tokenizer {}`",
                 dir.string(), theirs.fingerprint(),
                 theirs.is_bytes() ? "no tokenizer.model: bytes" : (from / kTokenizerFile).string(),
                 cfg_.data.dir, tokenizer_.fingerprint(), theirs.is_bytes() ? "byte" : from.string());
  if (!is_hf_model_dir(dir)) {
    // A checkpoint: each rank reads what it holds (under ZeRO-3 its shard), never the whole model.
    engine_->load_weights(from, bias_views(*model_));
    log_info("initial weights from {}", dir.string());
    return;
  }
  std::vector<float> weights;
  read_hf_weights(dir, *model_, weights);
  const FlatParams params = this->params();
  MOETRAIN_CHECK(weights.size() == params.size(), "--init-from {}: {} parameters, the model has {}",
                 dir.string(), weights.size(), params.size());
  std::copy(weights.begin(), weights.end(), params.begin());
  engine_->host_params_changed();
  log_info("initial weights from {}", dir.string());
}

nlohmann::json Trainer::trainer_state() const {
  const int64_t B = cfg_.train.batch_size, A = cfg_.train.grad_accum, W = data_replicas();
  const int64_t step = engine_->step_count();
  const ParallelLayout& pl = engine_->groups().layout;
  nlohmann::json t = engine_->state_json();
  t["config_hash"] = cfg_.config_hash();
  t["precision"] = precision_name(cfg_.train.precision);
  t["schedule"] = {
      {"position", step}, {"total_steps", cfg_.train.steps}, {"next_lr", engine_->schedule().lr(step)}};
  // Batches are a pure function of (seed, step, row of the global batch): the next step and the
  // global batch say where the data stands, whatever the layout (data/loader.h). The epoch and
  // the stream position follow from them; they are written for the reader.
  const int64_t windows = WindowStream::windows_in(*train_shard_, cfg_.train.seq_len);
  const int64_t next_window = step * B * A * W;
  t["data"] = {{"next_step", step},
               {"global_batch", B * A * W},
               {"next_window", next_window},
               {"windows_per_epoch", windows},
               {"epoch", windows > 0 ? next_window / windows : 0},
               {"batch_size", B},
               {"seq_len", cfg_.train.seq_len},
               {"train_tokens", train_shard_->size()}};
  // Every random stream is counter-based (seed, step, purpose): the seed and the step are the
  // whole generator state.
  t["rng"] = {{"seed", cfg_.train.seed}, {"next_step", step}};
  t["tokenizer"] = tokenizer_.fingerprint();
  t["layout"] = {{"processes", world_size()},
                 {"pp", cfg_.dist.pp},
                 {"ep", pl.ep},
                 {"dp", pl.dp},
                 {"zero", cfg_.dist.zero},
                 {"grad_accum", A}};
  return t;
}

fs::path Trainer::save_checkpoint() {
  return engine_->save_checkpoint(
      bias_views(*model_),
      {lm_checkpoint_config(cfg_), trainer_state(), tokenizer_.hf_files(cfg_.model.max_seq_len)},
      cfg_.train.keep_checkpoints);
}

void Trainer::restore_trainer_state(const nlohmann::json& t, const std::string& where) {
  const fs::path dir = fs::path(where).parent_path();
  const Precision used = cfg_.train.precision_was_auto && t.contains("precision") &&
                                 t["precision"].is_string()
                             ? parse_precision(t["precision"].get<std::string>())
                             : cfg_.train.precision;
  if (used != cfg_.train.precision) {
    // The run keeps the precision it started with, wherever it resumes.
    log_info("train.precision = auto: resuming in {} as the run was trained ({} here)",
             precision_name(used), precision_name(cfg_.train.precision));
    cfg_.train.precision = used;
    model_->set_precision(cfg_.train.precision_dtype());
    engine_->set_precision(cfg_.train.precision_dtype());
  }
  MOETRAIN_CHECK(t.is_object() && t.contains("config_hash"), "{}: no 'config_hash'", where);
  const std::string hash = t["config_hash"].get<std::string>();
  MOETRAIN_CHECK(hash == cfg_.config_hash(),
                 "{} was written with a different configuration (hash {} vs this run's {}): resume "
                 "with the same model, optimizer and batch settings, or use a new train.run_dir",
                 dir.string(), hash, cfg_.config_hash());
  // The same ids must mean the same text: a checkpoint before tokenizers were recorded is bytes.
  const std::string saved_tok = t.value("tokenizer", std::string("byte"));
  MOETRAIN_CHECK(saved_tok == tokenizer_.fingerprint(),
                 "{} was trained with the tokenizer {} ({}), but data.dir = {} was prepared with "
                 "{}: prepare the data with the checkpoint's tokenizer (`moetrain prepare "
                 "--tokenizer {}`), or use a new train.run_dir",
                 dir.string(), saved_tok,
                 saved_tok == "byte" ? "bytes" : (dir / kTokenizerFile).string(), cfg_.data.dir,
                 tokenizer_.fingerprint(), saved_tok == "byte" ? "byte" : dir.string());
  engine_->restore_state(t, where);

  // The global batch stays what it was: a different number of processes changes the number of
  // micro-batches per step (the windows of a step do not depend on how they are split).
  MOETRAIN_CHECK(t.contains("data") && t["data"].is_object() && t["data"].contains("global_batch"),
                 "{}: no 'data.global_batch'", where);
  const nlohmann::json& data = t["data"];
  const int64_t global = data["global_batch"].get<int64_t>();
  const int64_t per_micro = cfg_.train.batch_size * data_replicas();
  // The model's copies: the processes, or under pipeline parallelism the pipelines.
  const PipelineRunner* pipe = engine_->pipeline();
  const std::string copies =
      pipe ? fmt::format("{} model copies ({} pipelines of {} stages)", data_replicas(),
                         pipe->replicas(), pipe->stages())
           : fmt::format("{} processes", data_replicas());
  MOETRAIN_CHECK(global > 0 && global % per_micro == 0,
                 "{} was trained with a global batch of {} sequences per step; {} x "
                 "train.batch_size {} = {} sequences per micro-batch do not divide it: resume on a "
                 "process count that does",
                 dir.string(), global, copies, cfg_.train.batch_size, per_micro);
  if (global / per_micro != cfg_.train.grad_accum)
    log_info("train.grad_accum = {} instead of {}: {} keep the global batch of {} sequences per "
             "step",
             global / per_micro, cfg_.train.grad_accum, copies, global);
  if (pipe) {
    // The micro-batches the resumed step has must still suit the schedule.
    const std::string problem = pipe_shape_problem(
        pipe->schedule(), {pipe->stages(), global / per_micro, pipe->chunks_per_stage()});
    MOETRAIN_CHECK(problem.empty(), "resuming {}: {}", dir.string(), problem);
  }
  cfg_.train.grad_accum = global / per_micro;
  engine_->set_micro_batches(cfg_.train.grad_accum);
  const int64_t windows = WindowStream::windows_in(*train_shard_, cfg_.train.seq_len);
  const int64_t next_window = engine_->step_count() * global;
  log_info("data: epoch {}, {} of its {} windows read", next_window / windows,
           next_window % windows, windows);
  if (data.value("train_tokens", uint64_t{0}) != train_shard_->size())
    log_warn("{}: the training data had {} tokens, {} has {}: batches will differ", where,
             data.value("train_tokens", uint64_t{0}), train_shard_->path().string(),
             train_shard_->size());
}

void Trainer::load_checkpoint(const fs::path& dir) {
  engine_->load_checkpoint(dir, bias_views(*model_),
                           [&](const nlohmann::json& t, const std::string& where) {
                             restore_trainer_state(t, where);
                           });
}

}  // namespace moetrain
