#include "train/classifier_data.h"

#include <algorithm>

#include "core/check.h"
#include "io/checkpoint.h"
#include "train/run_state.h"

namespace fs = std::filesystem;

namespace moetrain {

ClassifierData load_classifier_data(const ClassifierRunConfig& cfg) {
  MOETRAIN_CHECK(fs::is_directory(cfg.data.dir),
                 "data.dir = '{}' is not a directory; Debian's dataset-fashion-mnist package "
                 "installs the data in {}",
                 cfg.data.dir, kFashionMnistDir);
  ClassifierData d;
  d.train = std::make_shared<const ImageDataset>(load_fashion_mnist("train", cfg.data.dir));
  d.test = std::make_shared<const ImageDataset>(load_fashion_mnist("t10k", cfg.data.dir));
  return d;
}

namespace {

void check_dataset(const ImageDataset& d, const ClassifierConfig& m, const char* which) {
  MOETRAIN_CHECK(d.n > 0, "the {} set is empty", which);
  MOETRAIN_CHECK(d.rows * d.cols == m.input_dim,
                 "the {} images have {}x{} = {} pixels, but model.input_dim = {}", which, d.rows,
                 d.cols, d.rows * d.cols, m.input_dim);
  MOETRAIN_CHECK(d.num_classes <= m.n_classes,
                 "the {} set has {} classes, but model.n_classes = {}", which, d.num_classes,
                 m.n_classes);
}

}  // namespace

void complete_classifier_data(ClassifierData& data, const ClassifierRunConfig& cfg) {
  if (!data.train || !data.test) {
    ClassifierData loaded = load_classifier_data(cfg);
    if (!data.train) data.train = loaded.train;
    if (!data.test) data.test = loaded.test;
  }
  check_dataset(*data.train, cfg.model, "training");
  check_dataset(*data.test, cfg.model, "test");
}

ClassifierEval evaluate_classifier(Classifier& model, const float* params, const ImageDataset& data,
                                   int64_t batch) {
  MOETRAIN_CHECK(batch > 0, "evaluate_classifier: batch {} must be positive", batch);
  MOETRAIN_CHECK(data.n > 0, "evaluate_classifier: the data set is empty");
  const int64_t D = model.config().input_dim;
  MOETRAIN_CHECK(data.rows * data.cols == D,
                 "evaluate_classifier: images of {}x{} pixels, model.input_dim = {}", data.rows,
                 data.cols, D);
  ClassifierEval out;
  double sum = 0;
  MoeStep step;
  step.training = false;
  for (int64_t at = 0; at < data.n; at += batch) {
    const int64_t n = std::min(batch, data.n - at);
    ClassifierLoss l =
        model.forward(params, data.images.data() + at * D, data.labels.data() + at, n, step);
    sum += l.ce * static_cast<double>(n);
    out.correct += l.correct;
    out.n += n;
  }
  out.loss = sum / static_cast<double>(out.n);
  out.accuracy = static_cast<double>(out.correct) / static_cast<double>(out.n);
  return out;
}

LoadedClassifier load_classifier(const fs::path& dir) {
  const fs::path ckpt = resolve_checkpoint(dir);
  verify_checkpoint(ckpt);
  nlohmann::json config = read_checkpoint_json(ckpt, "config.json");
  MOETRAIN_CHECK(
      config.value("model_type", std::string()) == "moe_classifier" && config.contains("moetrain"),
      "{}/config.json is not a moetrain classifier checkpoint (model_type '{}')", ckpt.string(),
      config.value("model_type", std::string()));
  LoadedClassifier out;
  out.config = classifier_config_from_json(config["moetrain"], (ckpt / "config.json").string());
  out.model = std::make_unique<Classifier>(out.config.model);
  out.step = read_weights(ckpt, *out.model, out.params);
  return out;
}

}  // namespace moetrain
