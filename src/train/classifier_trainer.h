// Training the MoE classifier through the LM trainer's machinery: deterministic mini-batches →
// the accumulation routine (train/accumulate.h) → the gradient reducer and the one update step
// (optim/grad_reducer.h, optim/update.h) → router-bias update, with test-set evaluation, the
// metrics writer, progress and collective checkpoints that resume bit for bit (train/run_state.h).
// `app/cmd_classify.cpp` only parses arguments and calls this.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm.h"
#include "data/idx.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "io/run_lock.h"
#include "optim/sparse_experts.h"
#include "model/classifier.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "parallel/groups.h"
#include "parallel/moe_exchange_setup.h"
#include "train/classifier_config.h"
#include "train/step_metrics.h"
#include "train/stop_signal.h"

namespace moetrain {

// Which training rows each step uses. Epoch e is a permutation of [0, n) drawn from (seed, e)
// alone (Fisher-Yates on counter-based numbers); step s takes rows s·B … s·B+B−1 of the epochs
// laid end to end, so a batch may straddle two epochs. A pure function of (seed, step).
class EpochSampler {
 public:
  EpochSampler(int64_t n, uint64_t seed);
  // rows (B) = the training rows of step `step` (0-based).
  void batch(int64_t step, int64_t B, int64_t* rows);
  // The permutation of epoch `e` (n).
  std::vector<int64_t> epoch(int64_t e) const;

 private:
  const std::vector<int64_t>& cached_epoch(int64_t e);

  int64_t n_;
  uint64_t seed_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> perm_;
};

// The training and test sets. A null member is loaded from the config's data.dir.
struct ClassifierData {
  std::shared_ptr<const ImageDataset> train, test;
};
ClassifierData load_classifier_data(const ClassifierRunConfig& cfg);

struct ClassifierEval {
  double loss = 0;      // mean cross-entropy
  double accuracy = 0;  // correct / n
  int64_t correct = 0, n = 0;
};

// Loss and accuracy over every row of `data`, `batch` rows per (inference) forward.
ClassifierEval evaluate_classifier(Classifier& model, const float* params, const ImageDataset& data,
                                   int64_t batch);

struct ClassifierTrainResult {
  int64_t steps_done = 0;
  double final_loss = 0;  // training loss of the last step
  double test_loss = 0, test_accuracy = 0;
  double seconds = 0;        // the whole run, evaluations and checkpoint included
  double train_seconds = 0;  // the steps alone
  double images_per_s = 0;
  std::filesystem::path checkpoint;
  int exit_code = 0;  // 130 / 143: stopped early by SIGINT / SIGTERM, with a checkpoint
};

class GradReducer;
class ShardedOptimizer;

// Under mpirun every process builds a ClassifierTrainer and runs it in step (every method is
// collective), laid out as the LM trainer is (world = DP × dist.ep, train/parallel_setup.h). Each
// rank takes its contiguous train.batch_size / P rows of every global batch; its MoE layers send
// tokens to the experts' owners over the EP group and reduce their balancing statistics over every
// process; the gradients are summed by the reducer (ZeRO-1 with dist.zero = 1); rank 0 writes the
// metrics; every rank writes its share of each checkpoint, which loads on any layout.
class ClassifierTrainer {
 public:
  // resume: continue from the run directory's latest complete checkpoint if there is one (a fresh
  // run replaces an earlier run's checkpoints and metrics). world: the processes of the run; null
  // means every process of the launch, or just this one without MPI.
  explicit ClassifierTrainer(ClassifierRunConfig cfg, ClassifierData data = {}, bool resume = false,
                             std::unique_ptr<Comm> world = nullptr);
  ~ClassifierTrainer();

  // Trains for the configured steps (or epochs), evaluates on the test set, writes the checkpoint.
  // stop_at ≥ 0: stops there with a checkpoint, as if interrupted; a resumed run continues it.
  ClassifierTrainResult run(int64_t stop_at = -1);

  const ClassifierRunConfig& config() const { return cfg_; }
  Classifier& model() { return *model_; }
  std::vector<float>& params() { return params_; }
  int64_t step() const { return step_; }
  int64_t total_steps() const { return total_steps_; }
  int rank() const { return world_->rank(); }
  int world_size() const { return world_->size(); }
  // The experts whose parameters this rank holds (params() is stale elsewhere).
  const ExpertShard& expert_shard() const { return expert_shard_; }

  // Collective: every rank writes its share of the checkpoint of the current step.
  std::filesystem::path save_checkpoint();

 private:
  double train_step();  // one optimizer step; returns the loss
  CheckpointShare checkpoint_share(bool reading);
  nlohmann::json trainer_state() const;
  void load_checkpoint(const std::filesystem::path& dir);

  ClassifierRunConfig cfg_;
  ClassifierData data_;
  std::unique_ptr<Comm> world_;
  std::unique_ptr<ProcessGroups> pg_;  // before model_: its MoE layers hold the communicators
  ExpertParallelSetup ep_;             // the MoE layers' expert exchange (distributed runs)
  std::unique_ptr<Classifier> model_;
  std::vector<float> params_, grads_;
  std::vector<ParamRange> groups_;
  std::unique_ptr<GradReducer> reducer_;
  bool read_carried_ = false;  // the checkpoint being read holds this run's gradient residual
  std::unique_ptr<ShardedOptimizer> optimizer_;
  std::unique_ptr<SparseExperts> sparse_;  // grad.sparse_experts (with MoE layers)
  std::unique_ptr<ExpertReweighter> reweight_;  // grad.expert_reweight ≠ none
  ExpertShard expert_shard_;  // the experts this rank holds (all but with dist.ep > 1)
  std::vector<int> writers_;  // (layout params) the rank that writes each into checkpoints
  std::unique_ptr<LrSchedule> schedule_;
  std::unique_ptr<EpochSampler> sampler_;
  int64_t step_ = 0, total_steps_ = 0;
  int64_t rows_per_rank_ = 0;    // Bl = B / P
  std::vector<int64_t> rows_;    // (B) the global batch's rows
  std::vector<float> inputs_;    // (Bl, D) this rank's
  std::vector<int32_t> labels_;  // (Bl)
  double last_lr_ = 0, last_grad_norm_ = 0;
  StopVotes stop_;                  // the last step's, agreed by every process
  nlohmann::json pending_metrics_;  // the last step's metrics line, completed by run()
  CommParts last_comm_;             // the last step's communication; run() adds its wall time
  RunLock run_lock_;                // rank 0's (before metrics_: released after its last write)
  MetricsWriter metrics_;           // rank 0's; inactive on the others
};

// A trained classifier read back from a checkpoint directory or a run directory (its latest
// complete checkpoint), router biases included.
struct LoadedClassifier {
  ClassifierRunConfig config;
  std::unique_ptr<Classifier> model;
  std::vector<float> params;
  int64_t step = 0;
};
LoadedClassifier load_classifier(const std::filesystem::path& dir);

}  // namespace moetrain
