// Training the MoE classifier: its mini-batches (train/classifier_data.h), its test-set
// evaluation and its checkpoint documents, handed to the step engine and the run loop, with
// collective checkpoints that resume bit for bit (train/run_state.h).
// `app/cmd_classify.cpp` only parses arguments and calls this.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include "core/comm.h"
#include "io/metrics.h"
#include "io/run_lock.h"
#include "model/classifier.h"
#include "train/classifier_config.h"
#include "train/classifier_data.h"
#include "train/run_loop.h"
#include "train/step_engine.h"

namespace moetrain {

struct ClassifierTrainResult : LoopResult {
  double test_loss = 0, test_accuracy = 0;  // the last evaluation's (0 when none ran)
  double images_per_s = 0;
};

// Under mpirun every process builds a ClassifierTrainer and runs it in step (every method is
// collective), laid out as the LM trainer is (world = DP × dist.ep, train/parallel_setup.h). Each
// rank takes its contiguous train.batch_size / P rows of every global batch; the step is the step
// engine's (train/step_engine.h), the loop the one run loop (train/run_loop.h); rank 0 writes the
// metrics; every rank writes its share of each checkpoint, which loads on any layout.
class ClassifierTrainer : private RunTask {
 public:
  // resume: continue from the run directory's latest complete checkpoint if there is one (a fresh
  // run replaces an earlier run's checkpoints and metrics). world: the processes of the run; null
  // means every process of the launch, or just this one without MPI.
  explicit ClassifierTrainer(ClassifierRunConfig cfg, ClassifierData data = {}, bool resume = false,
                             std::unique_ptr<Comm> world = nullptr);
  ~ClassifierTrainer() override;

  // Trains for the configured steps (or epochs), evaluates on the test set, writes the checkpoint.
  // stop_at ≥ 0: stops there with a checkpoint, as if interrupted; a resumed run continues it.
  ClassifierTrainResult run(int64_t stop_at = -1);

  const ClassifierRunConfig& config() const { return cfg_; }
  Classifier& model() { return *model_; }
  FlatParams params() { return engine_->params(); }
  int64_t step() const { return engine_->step_count(); }
  int64_t total_steps() const { return total_steps_; }
  int rank() const { return world_->rank(); }
  int world_size() const { return world_->size(); }
  // The experts whose parameters this rank holds (params() is stale elsewhere).
  const ExpertShard& expert_shard() const { return engine_->expert_shard(); }

  // Collective: every rank writes its share of the checkpoint of the current step.
  std::filesystem::path save_checkpoint() override;

 private:
  StepResult train_step() override;
  Evaluation evaluate() override;
  void load_checkpoint(const std::filesystem::path& dir);

  ClassifierRunConfig cfg_;
  ClassifierData data_;
  std::unique_ptr<Comm> world_;
  std::unique_ptr<Classifier> model_;
  std::unique_ptr<StepEngine> engine_;
  std::unique_ptr<EpochSampler> sampler_;
  int64_t total_steps_ = 0;
  int64_t rows_per_rank_ = 0;    // Bl = B / P
  std::vector<int64_t> rows_;    // (B) the global batch's rows
  std::vector<float> inputs_;    // (Bl, D) this rank's
  std::vector<int32_t> labels_;  // (Bl)
  RunLock run_lock_;             // rank 0's (before metrics_: released after its last write)
  MetricsWriter metrics_;        // rank 0's; inactive on the others
};

}  // namespace moetrain
