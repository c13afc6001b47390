// Everything a classifier training run is told: [model] (ClassifierConfig), [data], [optim]
// (the LM's OptimSettings), [train], [dist] (the LM's DistSettings) and [grad] (the LM's
// GradSettings). Loaded from TOML plus `--set key=value` overrides through the shared
// ConfigSchema, validated once; errors name the key and what is allowed.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "data/idx.h"
#include "model/classifier.h"
#include "train/run_config.h"

namespace moetrain {

struct ClassifierDataConfig {
  std::string dir = kFashionMnistDir;  // train-*.gz and t10k-*.gz in the IDX format
};

struct ClassifierTrainConfig {
  int64_t steps = 1500;  // optimizer steps (0 when train.epochs sets the length)
  int64_t epochs = 0;    // > 0: ceil(epochs · training images / batch_size) steps
  int64_t batch_size = 128;
  uint64_t seed = 1234;
  int64_t eval_every = 0;          // test-set evaluation every n steps; 0 = only at the end
  int64_t eval_batch_size = 1000;  // rows per evaluation forward
  int64_t threads = 0;             // 0 = all cores
  std::string run_dir = "runs/fashion_mnist";
  std::string progress = "auto";  // auto | bar | lines | off
  bool tensorboard = true;        // metrics also as TensorBoard events in run_dir/tb
  int64_t checkpoint_every = 0;   // a checkpoint every n steps (besides the last); 0 = none
  bool profile = false;           // each step's phases in its metrics line (as the LM's)
};

struct ClassifierRunConfig {
  ClassifierConfig model;
  ClassifierDataConfig data;
  OptimSettings optim;
  ClassifierTrainConfig train;
  DistSettings dist;
  GradSettings grad;  // [grad]

  void validate() const;
  nlohmann::json to_json() const;
  // What a resumed run must share with the run that wrote its checkpoint, as 16 hex digits.
  std::string config_hash() const;
  // Optimizer steps of the run for a training set of n_train rows.
  int64_t total_steps(int64_t n_train) const;
};

// Loads `path` (may be empty: defaults only), then applies `overrides` ("model.dim=64").
ClassifierRunConfig load_classifier_config(const std::string& path,
                                           const std::vector<std::string>& overrides = {});
// The inverse of ClassifierRunConfig::to_json (as stored in a checkpoint's config.json); validated.
ClassifierRunConfig classifier_config_from_json(const nlohmann::json& j, const std::string& where);
// Every key this loader knows, "section.key".
std::vector<std::string> classifier_config_keys();
// run_config_help for the classifier's keys.
std::string classifier_config_help(const std::string& section);

}  // namespace moetrain
