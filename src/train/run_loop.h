// The one run loop of every trainer (the language model, the classifier): steps until the run's
// length or a stop, and around each step the metrics line (timings, communication, per-rank
// figures, profiled phases), the progress display, the stop signals (SIGINT / SIGTERM end the run
// with a checkpoint), the periodic evaluation and checkpoints; at the end the final evaluation
// and checkpoint. What differs between models comes in through RunTask.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "io/checkpoint.h"
#include "io/metrics.h"
#include "io/run_lock.h"
#include "train/step_engine.h"

namespace moetrain {

struct Evaluation {
  nlohmann::json metrics;  // the fields of its metrics line besides "step" ("val_loss", ...)
  std::string note;        // for the progress display: "validation loss 1.2345 nats/byte"
};

// What the loop drives: one model's step (through the step engine), its evaluation, its
// checkpoint. Every call is collective under MPI.
class RunTask {
 public:
  virtual ~RunTask() = default;
  virtual StepResult train_step() = 0;
  virtual Evaluation evaluate() = 0;
  virtual std::filesystem::path save_checkpoint() = 0;
};

struct LoopSettings {
  int64_t total_steps = 0;  // the run's length
  int64_t stop_at = -1;     // ≥ 0: stop there with a checkpoint, as if interrupted
  int64_t eval_every = 0, checkpoint_every = 0;  // 0: only at the end
  std::string progress = "auto";                 // train.progress (rank 0 shows it)
  bool profile = false;                          // train.profile: each step's phases
  double units_per_step = 0;                     // tokens (images) a step trains on, all ranks
  std::string unit = "tokens";                   // the rate's key is "<unit>_per_s"
  // Stopped at stop_at before total_steps: evaluate as at the end (true), or only write the
  // checkpoint (false; an evaluation still falls on an eval_every boundary).
  bool evaluate_when_stopped = true;
};

// The settings a trainer's [train] section (TrainConfig, ClassifierTrainConfig) gives; the caller
// adds the throughput's unit.
template <class Train>
LoopSettings loop_settings(const Train& t, int64_t total_steps, int64_t stop_at) {
  LoopSettings s;
  s.total_steps = total_steps;
  s.stop_at = stop_at;
  s.eval_every = t.eval_every;
  s.checkpoint_every = t.checkpoint_every;
  s.progress = t.progress;
  s.profile = t.profile;
  return s;
}

struct LoopResult {
  int64_t first_step = 0;  // where the run started (> 0 when resumed)
  int64_t steps_done = 0;
  double final_loss = 0;     // the last step's training loss
  nlohmann::json last_eval;  // the last evaluation's fields (null when none ran)
  double seconds = 0;        // the whole run, evaluations and checkpoints included
  double train_seconds = 0;  // the steps alone
  double rate = 0;           // units per second of the steps
  std::filesystem::path last_checkpoint;
  int exit_code = 0;  // 130 / 143: stopped by SIGINT / SIGTERM, with a checkpoint
  // The most resident memory any rank had (VmHWM) by the end of the run, bytes; < 0: unknown.
  double peak_rss = -1;
};

// How a fresh run (no --resume) treats a run directory that holds an earlier run's checkpoints.
enum class EarlierRun {
  Refuse,   // stop with an error naming --resume (the LM: hours of training are not thrown away)
  Replace,  // remove them (the classifier: a run of minutes)
};

// What every rank agrees on before the first step (check_ranks_agree): the settings, the
// configuration's hash.
struct RunIdentity {
  nlohmann::json settings;  // rank_settings(config, data sizes)
  uint64_t config_hash = 0;
};

// Collective, before the first step: checks that the ranks agree (before anything is created),
// locks the run directory (lock), resumes from its latest complete checkpoint when `resume` (load
// reads it into the trainer) or starts fresh as `earlier` says, and opens rank 0's metrics
// (metrics, also given to the engine). Returns the checkpoint resumed from, if any.
std::optional<std::filesystem::path> open_run(StepEngine& engine, const std::string& run_dir,
                                              bool resume, EarlierRun earlier, bool tensorboard,
                                              const CheckpointLoad& load,
                                              const RunIdentity& identity, RunLock& lock,
                                              MetricsWriter& metrics);

// Collective. metrics: rank 0's writer (inactive on the others).
LoopResult run_loop(StepEngine& engine, RunTask& task, const LoopSettings& settings,
                    MetricsWriter& metrics);

}  // namespace moetrain
