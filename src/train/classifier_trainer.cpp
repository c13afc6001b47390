#include "train/classifier_trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>

#include "core/check.h"
#include "core/log.h"
#include "core/rng.h"
#include "core/threads.h"
#include "core/timer.h"
#include "optim/clip.h"
#include "optim/param_groups.h"
#include "train/progress.h"

namespace fs = std::filesystem;

namespace moetrain {

EpochSampler::EpochSampler(int64_t n, uint64_t seed) : n_(n), seed_(seed) {
  MOETRAIN_CHECK(n > 0, "EpochSampler: the training set has {} rows, needs at least one", n);
}

std::vector<int64_t> EpochSampler::epoch(int64_t e) const {
  MOETRAIN_CHECK(e >= 0, "EpochSampler: epoch {} is negative", e);
  std::vector<int64_t> perm(static_cast<std::size_t>(n_));
  for (int64_t i = 0; i < n_; ++i) perm[i] = i;
  Rng rng(seed_, rng_stream(RngPurpose::Data, static_cast<uint64_t>(e), 0));
  for (int64_t i = n_ - 1; i > 0; --i) {
    auto j =
        static_cast<int64_t>(rng.below(static_cast<uint64_t>(i), static_cast<uint64_t>(i + 1)));
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

// Steps move through the epochs in order, so one cached permutation serves all but the batches
// that straddle two epochs.
const std::vector<int64_t>& EpochSampler::cached_epoch(int64_t e) {
  if (e != cached_epoch_) perm_ = epoch(e), cached_epoch_ = e;
  return perm_;
}

void EpochSampler::batch(int64_t step, int64_t B, int64_t* rows) {
  MOETRAIN_CHECK(step >= 0 && B >= 0, "EpochSampler::batch: step {} and batch {} must be ≥ 0", step,
                 B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t at = step * B + b;
    rows[b] = cached_epoch(at / n_)[at % n_];
  }
}

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

namespace {

std::string router_bias_name(int64_t layer) {
  return fmt::format("model.layers.{}.block_sparse_moe.router_bias", layer);
}

std::vector<NamedTensor> model_views(const ParamTable& layout, float* params) {
  std::vector<NamedTensor> out;
  for (const auto& p : layout.params()) out.push_back({p.name, p.shape, params + p.offset});
  return out;
}

// Router biases of the aux-loss-free router: state, not parameters.
std::vector<NamedTensor> bias_views(Classifier& model) {
  std::vector<NamedTensor> out;
  const ClassifierConfig& cfg = model.config();
  if (cfg.moe().router != RouterKind::SigmoidBias) return out;
  auto moe = model.moe_layers();
  for (int64_t l = 0; l < cfg.n_layers; ++l)
    out.push_back({router_bias_name(l), {cfg.n_experts}, moe[l]->router_bias()});
  return out;
}

void check_dataset(const ImageDataset& d, const ClassifierConfig& m, const char* which) {
  MOETRAIN_CHECK(d.n > 0, "the {} set is empty", which);
  MOETRAIN_CHECK(d.rows * d.cols == m.input_dim,
                 "the {} images have {}x{} = {} pixels, but model.input_dim = {}", which, d.rows,
                 d.cols, d.rows * d.cols, m.input_dim);
  MOETRAIN_CHECK(d.num_classes <= m.n_classes,
                 "the {} set has {} classes, but model.n_classes = {}", which, d.num_classes,
                 m.n_classes);
}

double imbalance(const std::vector<int64_t>& load) {
  int64_t mx = 0, sum = 0;
  for (int64_t v : load) mx = std::max(mx, v), sum += v;
  return sum > 0
             ? static_cast<double>(mx) * static_cast<double>(load.size()) / static_cast<double>(sum)
             : 1.0;
}

}  // namespace

ClassifierTrainer::ClassifierTrainer(ClassifierRunConfig cfg, ClassifierData data)
    : cfg_(std::move(cfg)), data_(std::move(data)) {
  cfg_.validate();
  int threads = init_threads(static_cast<int>(cfg_.train.threads));
  if (!data_.train || !data_.test) {
    ClassifierData loaded = load_classifier_data(cfg_);
    if (!data_.train) data_.train = loaded.train;
    if (!data_.test) data_.test = loaded.test;
  }
  check_dataset(*data_.train, cfg_.model, "training");
  check_dataset(*data_.test, cfg_.model, "test");
  total_steps_ = cfg_.total_steps(data_.train->n);

  model_ = std::make_unique<Classifier>(cfg_.model);
  const ClassifierLayout& layout = model_->layout();
  params_.assign(static_cast<std::size_t>(layout.size()), 0.0f);
  grads_.assign(params_.size(), 0.0f);
  init_classifier_params(params_.data(), layout, cfg_.model, cfg_.train.seed);
  groups_ = param_groups(layout);
  optimizer_ = make_optimizer(cfg_.optim.optimizer_config(), groups_, 0, layout.size());
  schedule_ = std::make_unique<LrSchedule>(cfg_.optim.schedule_config(total_steps_));
  sampler_ = std::make_unique<EpochSampler>(data_.train->n, cfg_.train.seed);

  const int64_t B = cfg_.train.batch_size;
  rows_.resize(static_cast<std::size_t>(B));
  inputs_.resize(static_cast<std::size_t>(B * cfg_.model.input_dim));
  labels_.resize(static_cast<std::size_t>(B));

  // A fresh run replaces what an earlier run left in the directory, metrics and checkpoints alike
  // (checkpoints are kept by step number, so a longer old run's would outrank this run's).
  const fs::path run_dir = cfg_.train.run_dir;
  fs::create_directories(run_dir);
  if (fs::exists(run_dir / "checkpoints")) {
    log_info("{}: removing the checkpoints of an earlier run", run_dir.string());
    fs::remove_all(run_dir / "checkpoints");
  }
  std::ofstream(run_dir / "metrics.jsonl", std::ios::trunc);

  log_info(
      "classifier: {} blocks of {} experts (top-{}), C = {}, F = {}, {:.3f}M parameters; {} "
      "threads",
      cfg_.model.n_layers, cfg_.model.n_experts, cfg_.model.top_k, cfg_.model.dim,
      cfg_.model.expert_hidden, static_cast<double>(layout.size()) / 1e6, threads);
  log_info("data: {} training / {} test images; {} steps of {} ({:.2f} epochs)", data_.train->n,
           data_.test->n, total_steps_, B,
           static_cast<double>(total_steps_ * B) / static_cast<double>(data_.train->n));
}

ClassifierTrainer::~ClassifierTrainer() = default;

CheckpointContents ClassifierTrainer::checkpoint_views() {
  CheckpointContents c;
  const ClassifierLayout& layout = model_->layout();
  c.model = model_views(layout, params_.data());
  for (const StateBuffer& sb : optimizer_->state()) {
    for (const auto& p : layout.params())
      c.optimizer.push_back({sb.name + "." + p.name, p.shape, sb.values.data() + p.offset});
  }
  c.state = bias_views(*model_);
  c.config = {{"model_type", "moe_classifier"},
              {"num_labels", cfg_.model.n_classes},
              {"input_dim", cfg_.model.input_dim},
              {"moetrain", cfg_.to_json()}};
  c.trainer = {{"step", step_},
               {"seed", cfg_.train.seed},
               {"optimizer", {{"name", cfg_.optim.name}, {"step_count", optimizer_->step_count()}}},
               {"data", {{"next_step", step_}, {"train_rows", data_.train->n}}}};
  return c;
}

double ClassifierTrainer::train_step() {
  const int64_t B = cfg_.train.batch_size, D = cfg_.model.input_dim;
  const ImageDataset& train = *data_.train;
  sampler_->batch(step_, B, rows_.data());
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(inputs_.data() + b * D, train.images.data() + rows_[b] * D, sizeof(float) * D);
    labels_[b] = train.labels[rows_[b]];
  }
  std::fill(grads_.begin(), grads_.end(), 0.0f);
  MoeStep ms;
  ms.training = true;
  ms.seed = cfg_.train.seed;
  ms.step = static_cast<uint64_t>(step_);
  ClassifierLoss p = model_->forward(params_.data(), inputs_.data(), labels_.data(), B, ms);
  MOETRAIN_CHECK(
      std::isfinite(p.total),
      "step {}: the loss is {} (cross-entropy {}, aux {}, z {}); stopping. Lower optim.lr or raise "
      "optim.warmup_steps",
      step_ + 1, p.total, p.ce, p.aux, p.z);
  model_->backward(params_.data(), grads_.data(), 1.0f);
  const int64_t n = static_cast<int64_t>(grads_.size());
  MOETRAIN_CHECK(!has_non_finite(grads_.data(), n), "step {}: non-finite gradient; stopping",
                 step_ + 1);
  const double gnorm = cfg_.optim.grad_clip > 0
                           ? clip_grad_norm(grads_.data(), n, cfg_.optim.grad_clip)
                           : grad_norm(grads_.data(), n);
  last_lr_ = schedule_->lr(step_);
  optimizer_->step(params_.data(), grads_.data(), static_cast<float>(last_lr_));

  auto moe = model_->moe_layers();
  if (cfg_.model.moe().router == RouterKind::SigmoidBias)
    for (MoeLayer* m : moe) m->apply_bias_update();
  std::vector<std::vector<int64_t>> load;
  std::vector<double> dropped;
  double imb = 0;
  for (MoeLayer* m : moe) {
    const MoeStats& s = m->stats();
    load.push_back(s.tokens_per_expert);
    dropped.push_back(s.fraction_dropped);
    imb += imbalance(load.back());
  }
  ++step_;
  pending_metrics_ = {{"step", step_},
                      {"loss", p.total},
                      {"ce", p.ce},
                      {"aux", p.aux},
                      {"z", p.z},
                      {"accuracy", static_cast<double>(p.correct) / static_cast<double>(B)},
                      {"lr", last_lr_},
                      {"grad_norm", gnorm},
                      {"tokens_per_expert", load},
                      {"dropped_fraction", dropped},
                      {"imbalance", imb / static_cast<double>(moe.size())}};
  return p.total;
}

void ClassifierTrainer::write_metrics_line(const nlohmann::json& line) {
  std::ofstream out(fs::path(cfg_.train.run_dir) / "metrics.jsonl", std::ios::app);
  out << line.dump() << "\n";
}

ClassifierTrainResult ClassifierTrainer::run() {
  ClassifierTrainResult result;
  const int64_t B = cfg_.train.batch_size, eval_batch = cfg_.train.eval_batch_size;
  Progress progress(parse_progress_mode(cfg_.train.progress), step_, total_steps_);
  Timer run_timer;
  auto evaluate = [&] {
    ClassifierEval ev = evaluate_classifier(*model_, params_.data(), *data_.test, eval_batch);
    write_metrics_line({{"step", step_}, {"test_loss", ev.loss}, {"test_accuracy", ev.accuracy}});
    return ev;
  };
  while (step_ < total_steps_) {
    Timer t;
    result.final_loss = train_step();
    const double dt = t.seconds();
    result.train_seconds += dt;
    // Timings live under their own keys so that everything else in a line is reproducible bit for
    // bit.
    pending_metrics_["step_time_s"] = dt;
    pending_metrics_["images_per_s"] = static_cast<double>(B) / dt;
    write_metrics_line(pending_metrics_);
    progress.update({step_, total_steps_, result.final_loss, static_cast<double>(B) / dt, last_lr_,
                     pending_metrics_["imbalance"].get<double>()});
    if (cfg_.train.eval_every > 0 && step_ % cfg_.train.eval_every == 0 && step_ < total_steps_) {
      ClassifierEval ev = evaluate();
      progress.note(fmt::format("step {}: test accuracy {:.2f}%, loss {:.4f}", step_,
                                100 * ev.accuracy, ev.loss));
    }
  }
  progress.finish();
  ClassifierEval ev = evaluate();
  result.test_loss = ev.loss;
  result.test_accuracy = ev.accuracy;
  result.checkpoint = write_checkpoint(cfg_.train.run_dir, step_, checkpoint_views(), 1);
  result.steps_done = step_;
  result.seconds = run_timer.seconds();
  result.images_per_s =
      result.train_seconds > 0 ? static_cast<double>(B * step_) / result.train_seconds : 0.0;
  log_info(
      "done: {} steps in {:.1f} s ({:.0f} images/s); test accuracy {:.2f}% ({}/{}), loss {:.4f}; "
      "checkpoint {}",
      step_, result.seconds, result.images_per_s, 100 * ev.accuracy, ev.correct, ev.n, ev.loss,
      result.checkpoint.string());
  return result;
}

LoadedClassifier load_classifier(const fs::path& dir) {
  fs::path ckpt = dir;
  if (!fs::is_regular_file(dir / "manifest.json")) {
    auto latest = find_latest_checkpoint(dir);
    MOETRAIN_CHECK(
        latest.has_value(),
        "{}: neither a checkpoint directory nor a run directory with a complete checkpoint",
        dir.string());
    ckpt = *latest;
  }
  verify_checkpoint(ckpt);
  nlohmann::json config = read_checkpoint_json(ckpt, "config.json");
  MOETRAIN_CHECK(
      config.value("model_type", std::string()) == "moe_classifier" && config.contains("moetrain"),
      "{}/config.json is not a moetrain classifier checkpoint (model_type '{}')", ckpt.string(),
      config.value("model_type", std::string()));
  LoadedClassifier out;
  out.config = classifier_config_from_json(config["moetrain"], (ckpt / "config.json").string());
  out.model = std::make_unique<Classifier>(out.config.model);
  out.params.assign(static_cast<std::size_t>(out.model->layout().size()), 0.0f);
  CheckpointContents c;
  c.model = model_views(out.model->layout(), out.params.data());
  c.state = bias_views(*out.model);
  read_checkpoint(ckpt, c);
  out.step = c.trainer.value("step", int64_t{0});
  return out;
}

}  // namespace moetrain
