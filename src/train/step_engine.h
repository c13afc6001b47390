// The one training step of every model and mode. A step, top to bottom:
//
//   micro-batches   fill → forward → backward, A times (train/accumulate.h); the gradient
//                   reduction begins before the last backward and overlaps it
//   reduce          the reducer completes the sum over the processes (parallel/reducer.h)
//   check and clip  non-finite check, fp16 unscale, expert reweighting, global norm, clip
//                   (optim/update.h)
//   step            the optimizer on what this process holds the state of
//   finish          ZeRO-1's parameter gather; local steps' averaging
//   controllers     router-bias update, dynamic capacity, RL gating, hot-expert placement, and
//                   the step's figures reduced over the processes (train/step_finish.h)
//
// The engine is built once from the config sections, the model's parameter table and the
// process groups, and owns everything a step changes: the parameters and gradients (one flat
// buffer each, the model's ParamTable order), the reducer, the optimizer, the schedule, the loss
// scaler, the sparse-expert mask, the reweighting, placement, the capacity and gating controllers
// and the stop votes. The LM trainer and the classifier trainer hand it their model and their
// micro-batches; the run loop (train/run_loop.h) drives it.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm.h"
#include "core/page_buffer.h"
#include "core/dtype.h"
#include "core/timer.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "model/config.h"
#include "model/trainable.h"
#include "moe/capacity_controller.h"
#include "moe/gating_controller.h"
#include "moe/placement.h"
#include "optim/device_state.h"
#include "optim/loss_scale.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "optim/sharded_optimizer.h"
#include "optim/sparse_experts.h"
#include "parallel/groups.h"
#include "parallel/moe_exchange_setup.h"
#include "parallel/param_averaging.h"
#include "parallel/reducer.h"
#include "train/accumulate.h"
#include "train/parallel_setup.h"
#include "train/pipeline_step.h"
#include "train/run_config.h"
#include "train/step_finish.h"
#include "train/step_metrics.h"
#include "train/stop_signal.h"

namespace moetrain {

// A model's flat parameter buffer as a view; it converts to a copy (std::vector<float>).
struct FlatParams : std::span<float> {
  using std::span<float>::span;
  operator std::vector<float>() const { return {begin(), end()}; }
};

class ExpertPlacement;

// What the engine takes from a run's configuration (RunConfig, ClassifierRunConfig), each
// section already parsed and validated when the configuration loaded.
struct EngineConfig {
  MoeModelConfig moe;  // capacity and router controllers
  MoeConfig moe_layer;  // what the model's MoE layers run with (model.moe())
  OptimSettings optim;
  DistSettings dist;
  GradSettings grad;
  PlacementConfig placement;  // hot-expert replication (off unless configured)
  uint64_t seed = 0;
  int64_t micro_batches = 1;  // A: micro-batches per optimizer step on each process
  int64_t total_steps = 0;    // the schedule's length
  DType precision = DType::F32;  // F16 runs with a dynamic loss scaler
  LossScaleConfig loss_scale;
  std::string run_dir;  // where the last good checkpoint is kept (named in errors)
};

// The sections every run configuration shares (RunConfig, ClassifierRunConfig); the caller sets
// what only its model has (placement, precision).
template <class RunCfg>
EngineConfig engine_config(const RunCfg& c, int64_t micro_batches, int64_t total_steps) {
  EngineConfig e;
  e.moe = c.model;  // the MoE part of the model's configuration
  e.moe_layer = c.model.moe();
  e.optim = c.optim;
  e.dist = c.dist;
  e.grad = c.grad;
  e.seed = c.train.seed;
  e.micro_batches = micro_batches;
  e.total_steps = total_steps;
  e.run_dir = c.train.run_dir;
  return e;
}

// One step's micro-batches on this process.
template <class Batch>
struct MicroBatches {
  std::function<Batch(int64_t micro)> fill;
  // This process's first token (row) in the step's global batch: router noise is drawn per
  // global token, so a split over processes draws what the one-process run draws.
  int64_t token_offset = 0;
  double global_tokens = 0;   // tokens (rows) the step trains on over every process
  int64_t accuracy_rows = 0;  // > 0 (classifier): the line holds accuracy over these rows
};

// What a step produced: its loss, its metrics line (without wall-clock figures, which the run
// loop adds) and its communication.
struct StepResult {
  double loss = 0;
  double lr = 0;
  nlohmann::json metrics;
  CommParts comm;
  // ≥ 0: a stop request abandoned the step after this many of its micro-batches; nothing was
  // updated (the engine stands at the last complete step) and stop_votes() says who asked.
  int64_t abandoned_after = -1;
};

class StepEngine {
 public:
  // Collective over rp's groups. init_params(params, from, to) fills the fresh parameters of the
  // tensors whose offsets lie in [from, to) (ZeRO-3 fills one unit at a time). device: a resident
  // device holding the parameters, gradients and moments between checkpoints
  // (train.device = cuda; null on the CPU).
  StepEngine(const EngineConfig& cfg, RunParallel rp, TrainableModel& model,
             const std::function<void(float* params, int64_t from, int64_t to)>& init_params,
             DeviceTrainingState* device = nullptr);
  ~StepEngine();
  StepEngine(const StepEngine&) = delete;
  StepEngine& operator=(const StepEngine&) = delete;

  // Collective: one optimizer step. model is the one the engine was built with (its concrete
  // type, whose forward_micro takes Batch).
  template <class Model, class Batch>
  StepResult step(Model& model, const MicroBatches<Batch>& batches);

  // dist.sync = params: collective, the replicas' parameters (and moments with
  // dist.sync_moments) averaged, unless they already were at this step. No-op otherwise.
  void average_replicas();

  // --- checkpoints --------------------------------------------------------------------------
  // Collective: every rank writes its share of the checkpoint of the current step; `state` are
  // views of state tensors besides the parameters (router biases).
  std::filesystem::path save_checkpoint(const std::vector<NamedTensor>& state,
                                        const CheckpointDocs& docs, int64_t keep);
  // Reads a checkpoint into the engine: restore(trainer_state.json, its path) restores the
  // state (restore_state for the engine's part), then each rank reads the ranges it holds.
  void load_checkpoint(const std::filesystem::path& dir, const std::vector<NamedTensor>& state,
                       const std::function<void(const nlohmann::json&, const std::string&)>& restore);
  // Collective: the weights of another run's checkpoint (--init-from), verified, each rank
  // reading the ranges it holds (ZeRO-3: its shard only), and `state` (router biases); nothing
  // of that run's optimizer or training state.
  void load_weights(const std::filesystem::path& dir, const std::vector<NamedTensor>& state);
  // The engine's part of trainer_state.json, and its restore (`where` names the file).
  nlohmann::json state_json() const;
  void restore_state(const nlohmann::json& t, const std::string& where);
  // The parameters changed on the host (a load, --init-from): a resident device takes them again.
  void host_params_changed();

  // --- settings that a resume may change ------------------------------------------------------
  void set_micro_batches(int64_t a) { cfg_.micro_batches = a; }
  // F16 runs with a loss scaler: one is made when the precision becomes F16.
  void set_precision(DType p);
  // The metrics writer the averaging writes its drift to (rank 0's; may be inactive).
  void set_metrics(MetricsWriter* m) { metrics_ = m; }

  // --- state ---------------------------------------------------------------------------------
  int64_t step_count() const { return step_; }
  // The flat parameters. Under ZeRO-3 (params_sharded) only this rank's shard of them is current
  // outside a forward and backward: gather_params makes them whole until the next step.
  FlatParams params() { return FlatParams(params_.data(), static_cast<std::size_t>(params_.size())); }
  bool params_sharded() const { return zero3_ != nullptr; }
  // Collective. Every parameter current in params() (ZeRO-3; otherwise nothing to do).
  void gather_params();
  std::span<float> grads() { return grads_.span(); }
  ShardedOptimizer& optimizer() { return *optimizer_; }
  const LossScaler* loss_scaler() const { return scaler_.get(); }
  const LrSchedule& schedule() const { return *schedule_; }
  ProcessGroups& groups() { return *pg_; }
  Comm& control() { return *pg_->control; }
  const ExpertParallelSetup& expert_parallel() const { return ep_; }
  const ExpertShard& expert_shard() const { return expert_shard_; }
  // This rank's experts as flat ranges (offset, size).
  const std::vector<std::pair<int64_t, int64_t>>& own_expert_ranges() const { return own_experts_; }
  // "4 processes: 2 data-parallel x 2 expert-parallel (4 experts each), ZeRO-1; 3 gradient
  // buckets", for the log of a distributed run.
  std::string describe_layout() const;
  // The signals the last step saw, agreed by every process.
  const StopVotes& stop_votes() const { return stop_; }
  // dist.pp > 1: this process's pipeline stage (null otherwise).
  PipelineRunner* pipeline() const { return pipe_.get(); }

 private:
  // Before the micro-batches: the step's hooks for the accumulation routine.
  void begin_step(AccumulateHooks& hooks, int64_t token_offset);
  // After them: the update, the controllers and the figures.
  StepResult end_step(Accumulated& acc, const Timer& step_timer, double global_tokens,
                      int64_t accuracy_rows);
  // Or, when a stop request abandoned the micro-batches: nothing changes.
  StepResult abandon_step(const Accumulated& acc);
  std::string last_checkpoint_note() const;
  // reduce → check and clip → step → finish, on the host or on the resident device.
  struct Update {
    UpdateOutcome outcome;
    double inline_s = 0;   // the reducer communicated on this thread
    double blocked_s = 0;  // this thread ran or waited for the reduction and the gathers
    bool lp_copy_kept = false;  // the optimizer kept the model's low-precision copy current
  };
  Update update(float lr, const UpdateOptions& opts);
  // params: where the parameters written are (default: the flat buffer).
  CheckpointShare checkpoint_share(const std::vector<NamedTensor>& state, bool reading,
                                   float* params = nullptr);

  EngineConfig cfg_;
  TrainableModel& model_;
  std::unique_ptr<ProcessGroups> pg_;  // before the exchange users: they hold its communicators
  ExpertParallelSetup ep_;
  // dist.tp > 1: the tensor-parallel group the model computes with (after ep_: it may run on
  // ep_'s communication thread, so it goes first).
  std::unique_ptr<Comm> tp_;
  int tp_size_ = 1;
  // dist.sync = params with dist.tp > 1: the copies' communicators (train/parallel_setup.h),
  // before the reducer and the averager that use them.
  LocalCopies local_;
  ExpertShard expert_shard_;
  int world_ = 1;
  // (layout size) page-aligned: ZeRO-3 hands the pages outside this rank's shard back.
  PageBuffer params_;
  // (layout size) page-aligned: ZeRO-2 hands each reduced bucket's pages back to the system.
  PageBuffer grads_;
  std::vector<ParamRange> groups_;
  std::vector<std::pair<int64_t, int64_t>> own_experts_;
  std::unique_ptr<GradReducer> reducer_;
  // dist.zero = 3 on more than one process: the parameters' gathers (the model's param units).
  std::unique_ptr<Zero3Params> zero3_;
  int64_t buckets_ = 0;
  // dist.sync = params under MPI: the replicas step alone (on local_comm_) and are averaged
  // every dist.sync_every steps; averaged_at_ is the step they last were.
  std::unique_ptr<ParamAverager> averager_;
  std::unique_ptr<Comm> local_comm_;
  int64_t averaged_at_ = -1;
  std::unique_ptr<ShardedOptimizer> optimizer_;
  std::vector<int> writers_;  // (layout params) the rank that writes each into checkpoints
  std::unique_ptr<LrSchedule> schedule_;
  std::unique_ptr<LossScaler> scaler_;                // fp16
  std::vector<CapacityController> capacity_;          // model.capacity = dynamic: per MoE layer
  std::vector<GatingController> gating_;              // model.router_controller = rl
  std::unique_ptr<ExpertReweighter> reweight_;        // grad.expert_reweight ≠ none
  std::unique_ptr<SparseExperts> sparse_;             // grad.sparse_experts
  std::unique_ptr<ExpertPlacement> placement_;        // placement.spare_slots > 0
  DeviceTrainingState* device_ = nullptr;
  bool device_current_ = false;  // the device holds this run's current state
  bool read_carried_ = false;    // the checkpoint being read holds this run's gradient residual
  int64_t step_ = 0;             // optimizer steps applied so far
  double last_grad_norm_ = 0;
  StopVotes stop_;
  std::optional<StepCommMeter> meter_;  // the running step's communication readings
  int64_t skipped_before_ = 0;          // the reducer's skipped bytes when the step began
  SparseReduceFigures sparse_before_;   // grad.sparse_ratio: the reducer's figures then
  MetricsWriter* metrics_ = nullptr;
  // dist.pp > 1: the micro-batches run through the pipeline's stages; each process's optimizer
  // updates its stage's parameters and writes them into checkpoints.
  std::unique_ptr<PipelineRunner> pipe_;
  // The model's copies whose gradients are summed (world_, or the pipelines' copies).
  // The model's copies whose gradients are summed: a tensor-parallel group's ranks make one.
  int replicas() const {
    return pipe_ ? static_cast<int>(pipe_->replicas()) : world_ / tp_size_;
  }
};

// --- implementation ------------------------------------------------------------------------------

template <class Model, class Batch>
StepResult StepEngine::step(Model& model, const MicroBatches<Batch>& batches) {
  MOETRAIN_CHECK(static_cast<TrainableModel*>(&model) == &model_,
                 "StepEngine::step: a model other than the engine's");
  const Timer step_timer;
  AccumulateArgs<Batch> args;
  begin_step(args, batches.token_offset);
  args.fill = batches.fill;
  Accumulated acc;
  if constexpr (std::is_same_v<Model, Transformer>) {
    if (pipe_) {
      acc = pipe_->accumulate(model, params_.data(), grads_.data(),
                              static_cast<int64_t>(grads_.size()), args);
      if (acc.abandoned_after >= 0) return abandon_step(acc);
      return end_step(acc, step_timer, batches.global_tokens, batches.accuracy_rows);
    }
  }
  acc = accumulate(model, params_.data(), grads_.data(), static_cast<int64_t>(grads_.size()), args);
  if (acc.abandoned_after >= 0) return abandon_step(acc);
  return end_step(acc, step_timer, batches.global_tokens, batches.accuracy_rows);
}

}  // namespace moetrain
