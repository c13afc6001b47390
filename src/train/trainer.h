// Training the language model: its token shards and micro-batches, its validation, its checkpoint
// documents, handed to the step engine and the run loop. `app/` only parses arguments and calls
// this.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm.h"
#include "data/tokenizer.h"
#include "io/metrics.h"
#include "io/run_lock.h"
#include "model/transformer.h"
#include "train/lm_checkpoint.h"
#include "train/memory_estimate.h"
#include "train/run_config.h"
#include "train/run_loop.h"
#include "train/step_engine.h"

namespace moetrain {

class BatchLoader;
class TokenShard;

struct TrainResult : LoopResult {
  double val_loss = -1;  // the last validation loss (−1 when none was computed)
  double tokens_per_s = 0;
};

// Under mpirun every process builds a Trainer and runs it in step (every method is collective).
// World = DP × EP (dist.ep): each process reads its own train.batch_size sequences per
// micro-batch, experts are sharded over the EP group (parallel/mpi_exchange.h), gradients are
// reduced over the processes holding each parameter and averaged, so a run on P processes follows
// the single-process run with a P times larger batch. The step is the step engine's
// (train/step_engine.h), the loop the one run loop (train/run_loop.h); this class holds what is
// the language model's own: its token shards, its validation, its checkpoint documents. Only
// rank 0 writes metrics and progress; every rank writes its share of each checkpoint, which holds
// the whole model and loads on any layout (io/checkpoint.h).
class Trainer : private RunTask {
 public:
  // resume: continue from the run directory's latest complete checkpoint if there is one.
  // world: the processes of the run; null means every process of the launch (dist_world()), or
  // just this one without MPI.
  Trainer(RunConfig cfg, bool resume, std::unique_ptr<Comm> world = nullptr);
  ~Trainer() override;

  // Trains until train.steps (or until `stop_at` steps, when ≥ 0: the run stops there with a
  // checkpoint, as if interrupted, and a later --resume continues it).
  TrainResult run(int64_t stop_at = -1);

  const RunConfig& config() const { return cfg_; }
  // What the start-up check estimated this rank holds.
  const MemoryEstimate& memory_estimate() const { return memory_; }
  Transformer& model() { return *model_; }
  // Under dist.zero = 3 only this rank's shard is current between steps: gather_params
  // (collective) first makes them whole.
  FlatParams params() { return engine_->params(); }
  void gather_params() { engine_->gather_params(); }
  std::span<float> grads() { return engine_->grads(); }
  ShardedOptimizer& optimizer() { return engine_->optimizer(); }
  int64_t step() const { return engine_->step_count(); }
  // dist.pp > 1: this process's pipeline stage (null otherwise).
  const PipelineRunner* pipeline() const { return engine_->pipeline(); }
  int rank() const { return world_->rank(); }
  int world_size() const { return world_->size(); }
  // The model's data-parallel copies and this rank's among them, each reading its own batch:
  // the processes, or the pipelines and tensor-parallel groups (rank = (copy · dist.pp + stage) ·
  // dist.tp + t), whose stages and ranks all read the copy's batch.
  int data_replicas() const {
    return world_->size() / static_cast<int>(cfg_.dist.pp * cfg_.dist.tp);
  }
  int data_rank() const { return world_->rank() / static_cast<int>(cfg_.dist.pp * cfg_.dist.tp); }
  // This rank's experts as flat ranges (every expert on a single process).
  const std::vector<std::pair<int64_t, int64_t>>& own_expert_ranges() const {
    return engine_->own_expert_ranges();
  }
  // fp16 runs: the dynamic loss scaler (null otherwise).
  const LossScaler* loss_scaler() const { return engine_->loss_scaler(); }

  // Collective: every rank writes its share of the checkpoint of the current step.
  std::filesystem::path save_checkpoint() override;
  // The parameters (and router biases) of any directory load_model takes, in place of the
  // random init, before the first step; the optimizer state stays fresh. A resumed run keeps its
  // checkpoint's weights instead. The model must have DIR's architecture (adopt_architecture).
  void init_weights_from(const std::filesystem::path& dir);

 private:
  StepResult train_step() override;
  Evaluation evaluate() override;
  void load_checkpoint(const std::filesystem::path& dir);
  // trainer_state.json: the engine's state and the run's own (precision, schedule, data,
  // layout). To carry more state, add it here and restore it in restore_trainer_state.
  nlohmann::json trainer_state() const;
  void restore_trainer_state(const nlohmann::json& state, const std::string& where);

  RunConfig cfg_;
  MemoryEstimate memory_;  // this rank's, at start-up (train/memory_estimate.h)
  std::unique_ptr<Comm> world_;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<StepEngine> engine_;
  std::unique_ptr<TokenShard> train_shard_, val_shard_;
  std::unique_ptr<BatchLoader> loader_;  // this rank's training windows (data/loader.h)
  Tokenizer tokenizer_;  // data.dir's: recorded and shipped with every checkpoint
  bool resumed_ = false;
  std::vector<int32_t> inputs_, targets_;
  RunLock run_lock_;         // rank 0's (before metrics_: released after its last write)
  MetricsWriter metrics_;    // rank 0's; inactive on the others
};

}  // namespace moetrain
