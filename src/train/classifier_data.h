// The classifier's data: the training and test sets (Fashion-MNIST in the IDX format), which
// rows each step takes, and the evaluation over a whole set; and a trained classifier read back.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include "data/epoch_sampler.h"  // which training rows each step uses
#include "data/idx.h"
#include "model/classifier.h"
#include "train/classifier_config.h"

namespace moetrain {

// The training and test sets. A null member is loaded from the config's data.dir.
struct ClassifierData {
  std::shared_ptr<const ImageDataset> train, test;
};
ClassifierData load_classifier_data(const ClassifierRunConfig& cfg);
// Loads the sets `data` lacks, then checks both against the model (images of model.input_dim
// pixels, at most model.n_classes classes).
void complete_classifier_data(ClassifierData& data, const ClassifierRunConfig& cfg);

struct ClassifierEval {
  double loss = 0;      // mean cross-entropy
  double accuracy = 0;  // correct / n
  int64_t correct = 0, n = 0;
};

// Loss and accuracy over every row of `data`, `batch` rows per (inference) forward.
ClassifierEval evaluate_classifier(Classifier& model, const float* params, const ImageDataset& data,
                                   int64_t batch);

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
