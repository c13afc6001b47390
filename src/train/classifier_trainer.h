// Training the MoE classifier: deterministic mini-batches → forward → backward → clip → optimizer
// → router-bias update, with test-set evaluation, metrics, progress and a final checkpoint.
// `app/cmd_classify.cpp` only parses arguments and calls this.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/idx.h"
#include "io/checkpoint.h"
#include "model/classifier.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "train/classifier_config.h"

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
};

class ClassifierTrainer {
 public:
  explicit ClassifierTrainer(ClassifierRunConfig cfg, ClassifierData data = {});
  ~ClassifierTrainer();

  // Trains for the configured steps (or epochs), evaluates on the test set, writes the checkpoint.
  ClassifierTrainResult run();

  const ClassifierRunConfig& config() const { return cfg_; }
  Classifier& model() { return *model_; }
  std::vector<float>& params() { return params_; }
  int64_t step() const { return step_; }
  int64_t total_steps() const { return total_steps_; }

  // The checkpoint's contents as views into this trainer's buffers.
  CheckpointContents checkpoint_views();

 private:
  double train_step();  // one optimizer step; returns the loss
  void write_metrics_line(const nlohmann::json& line);

  ClassifierRunConfig cfg_;
  ClassifierData data_;
  std::unique_ptr<Classifier> model_;
  std::vector<float> params_, grads_;
  std::vector<ParamRange> groups_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<LrSchedule> schedule_;
  std::unique_ptr<EpochSampler> sampler_;
  int64_t step_ = 0, total_steps_ = 0;
  std::vector<int64_t> rows_;    // (B)
  std::vector<float> inputs_;    // (B, D)
  std::vector<int32_t> labels_;  // (B)
  double last_lr_ = 0;
  nlohmann::json pending_metrics_;  // the last step's metrics line, completed by run()
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
