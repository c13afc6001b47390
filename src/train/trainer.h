// The step loop: data → forward → backward → clip → optimizer → router-bias update, with
// evaluation, metrics, progress and checkpoints. `app/` only parses arguments and calls this.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "io/run_lock.h"
#include "model/transformer.h"
#include "moe/capacity_controller.h"
#include "moe/gating_controller.h"
#include "optim/device_state.h"
#include "optim/loss_scale.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "parallel/groups.h"
#include "parallel/moe_exchange_setup.h"
#include "optim/sparse_experts.h"
#include "parallel/param_averaging.h"
#include "train/run_config.h"
#include "train/step_metrics.h"
#include "train/stop_signal.h"

namespace moetrain {

class TokenShard;
class GradReducer;
class ShardedOptimizer;
class ExpertPlacement;

struct TrainResult {
  int64_t first_step = 0;  // the step the run started from (> 0 when resumed)
  int64_t steps_done = 0;  // optimizer steps taken by this run
  double final_loss = 0;   // training loss of the last step
  double val_loss = -1;    // last validation loss (−1 when none was computed)
  double seconds = 0;
  double tokens_per_s = 0;
  std::filesystem::path last_checkpoint;
  int exit_code = 0;  // 130 / 143: stopped early by SIGINT / SIGTERM, with a checkpoint
};

// A model with its parameters, for evaluation, sampling and the forward dump.
struct LoadedModel {
  RunConfig config;
  std::unique_ptr<Transformer> model;
  std::vector<float> params;
  std::vector<std::vector<float>> router_biases;  // per MoE layer (sigmoid_bias router)
  int64_t step = 0;
  // Sequence length the model was trained on (train.seq_len of the checkpoint's run config); a
  // checkpoint that does not record it gives model.max_seq_len.
  int64_t trained_context = 0;
};

// Loads a checkpoint directory, a run directory (its latest complete checkpoint), or a plain
// Hugging Face Mixtral directory (io/hf_checkpoint.h: step 0, the default run settings).
LoadedModel load_model(const std::filesystem::path& dir);

// The model configuration of any directory load_model takes.
ModelConfig model_config_of(const std::filesystem::path& dir);

// `train --init-from DIR`: `model` takes DIR's architecture (every key that changes the tensors or
// what they compute; each one that differs is logged), keeping the run's training coefficients
// (aux_loss_coef, z_loss_coef, bias_update_rate, init_std).
void adopt_architecture(ModelConfig& model, const ModelConfig& from, const std::string& where);

// Under mpirun every process builds a Trainer and runs it in step (every method is collective).
// World = DP × EP (dist.ep): each process reads its own train.batch_size sequences per
// micro-batch, experts are sharded over the EP group (parallel/mpi_exchange.h), gradients are
// reduced over the processes holding each parameter (parallel/grad_sync.h) and averaged, so a run
// on P processes follows the single-process run with a P times larger batch. Only rank 0 writes
// metrics and progress; every rank writes its share of each checkpoint, which holds the whole model
// and loads on any layout (io/checkpoint.h).
class Trainer {
 public:
  // resume: continue from the run directory's latest complete checkpoint if there is one.
  // world: the processes of the run; null means every process of the launch (dist_world()), or
  // just this one without MPI.
  Trainer(RunConfig cfg, bool resume, std::unique_ptr<Comm> world = nullptr);
  ~Trainer();

  // Trains until train.steps (or until `stop_at` steps, when ≥ 0: the run stops there with a
  // checkpoint, as if interrupted, and a later --resume continues it).
  TrainResult run(int64_t stop_at = -1);

  const RunConfig& config() const { return cfg_; }
  Transformer& model() { return *model_; }
  std::vector<float>& params() { return params_; }
  std::vector<float>& grads() { return grads_; }
  ShardedOptimizer& optimizer() { return *optimizer_; }
  int64_t step() const { return step_; }
  int rank() const;
  int world_size() const;
  // This rank's experts as flat ranges (every expert on a single process).
  const std::vector<std::pair<int64_t, int64_t>>& own_expert_ranges() const { return own_experts_; }

  // fp16 runs: the dynamic loss scaler (null otherwise).
  const LossScaler* loss_scaler() const { return scaler_.get(); }

  // Collective: every rank writes its share of the checkpoint of the current step.
  std::filesystem::path save_checkpoint();
  // The parameters (and router biases) of any directory load_model takes, in place of the
  // random init, before the first step; the optimizer state stays fresh. A resumed run keeps its
  // checkpoint's weights instead. The model must have DIR's architecture (adopt_architecture).
  void init_weights_from(const std::filesystem::path& dir);

 private:
  void load_checkpoint(const std::filesystem::path& dir);
  // What this rank writes into a checkpoint (reading = false: each element by one rank), or
  // reads from one (reading = true: every value it holds), as views into its buffers.
  CheckpointShare checkpoint_share(bool reading);
  CheckpointDocs checkpoint_docs() const;
  // trainer_state.json: everything but tensors that a resumed run needs. To carry more state,
  // add it here and restore it in restore_trainer_state.
  nlohmann::json trainer_state() const;
  void restore_trainer_state(const nlohmann::json& state, const std::filesystem::path& dir);
  // Collective: the ranks run the same configuration from the same step, or all fail.
  void check_ranks_agree();
  double train_step();  // one optimizer step; returns the loss
  // Reduce the gradients, then apply_update (optim/update.h): unscale, clip, step.
  void update();
  // dist.sync = params: collective, the replicas' parameters (and moments with
  // dist.sync_moments) averaged, unless they already were at this step.
  void average_replicas();

  RunConfig cfg_;
  std::unique_ptr<Comm> world_;
  std::unique_ptr<ProcessGroups> pg_;  // before model_: its MoE layers hold the communicators
  // The MoE layers' expert exchange, its 2-D route (dist.hierarchical) and the communication
  // thread that makes the gradient reductions and the chunked all-to-alls while the main thread
  // computes (distributed runs).
  ExpertParallelSetup ep_;
  std::unique_ptr<Transformer> model_;
  std::vector<float> params_, grads_;
  std::vector<ParamRange> groups_;
  std::vector<std::pair<int64_t, int64_t>> own_experts_;  // (offset, size)
  std::unique_ptr<GradReducer> reducer_;  // local identity on one process, GradSync under MPI
  int64_t buckets_ = 0;                   // gradient buckets (0 on one process)
  // dist.sync = params under MPI: the replicas step alone (on local_comm_) and are averaged
  // every dist.sync_every steps; averaged_at_ is the step they last were.
  std::unique_ptr<ParamAverager> averager_;
  std::unique_ptr<Comm> local_comm_;
  int64_t averaged_at_ = -1;
  std::unique_ptr<ShardedOptimizer> optimizer_;
  ExpertShard expert_shard_;  // the experts this rank holds
  std::vector<int> writers_;  // (layout params) the rank that writes each into checkpoints
  std::unique_ptr<LrSchedule> schedule_;
  std::unique_ptr<TokenShard> train_shard_, val_shard_;
  int64_t step_ = 0;  // optimizer steps applied so far
  bool resumed_ = false;
  bool read_carried_ = false;  // the checkpoint being read holds this run's gradient residual
  std::vector<int32_t> inputs_, targets_;
  // last step's figures, for metrics
  LossParts last_parts_;
  double last_grad_norm_ = 0, last_lr_ = 0;
  // Mixed precision: fp16's loss scaler, the scale the last step used, whether it was skipped.
  std::unique_ptr<LossScaler> scaler_;
  // model.capacity = dynamic: one controller per MoE layer (empty for a fixed capacity).
  std::vector<CapacityController> capacity_;
  bool auto_precision_ = false;  // train.precision was "auto" (a resume adopts the recorded one)
  std::unique_ptr<ExpertPlacement> placement_;  // placement.spare_slots > 0
  std::unique_ptr<SparseExperts> sparse_;        // grad.sparse_experts (with MoE layers)
  std::vector<GatingController> gating_;  // one per MoE layer with model.router_controller = rl
  std::unique_ptr<ExpertReweighter> reweight_;  // grad.expert_reweight ≠ none
  // train.device = cuda: the model's engine, resident (it holds the parameters, gradients and
  // AdamW moments between checkpoints); device_current_: it holds this run's current state.
  DeviceTrainingState* engine_ = nullptr;
  bool device_current_ = false;
  double last_scale_ = 1;
  bool last_skipped_ = false;
  StopVotes stop_;  // the last step's, agreed by every process
  CommParts last_comm_;             // the last step's communication; run() adds its wall time
  nlohmann::json pending_metrics_;  // the last step's metrics line, completed by run()
  RunLock run_lock_;                // rank 0's (before metrics_: released after its last write)
  MetricsWriter metrics_;           // rank 0's; inactive on the others
};

}  // namespace moetrain
