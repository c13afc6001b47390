#include "train/classifier_trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/fault.h"
#include "core/log.h"
#include "core/rng.h"
#include "core/threads.h"
#include "core/timer.h"
#include "optim/grad_reducer.h"
#include "optim/param_groups.h"
#include "optim/update.h"
#include "parallel/runtime.h"
#include "parallel/sharded_optimizer.h"
#include "train/accumulate.h"
#include "train/memory_estimate.h"
#include "train/parallel_setup.h"
#include "train/progress.h"
#include "train/run_state.h"
#include "train/rank_timing.h"
#include "train/step_metrics.h"
#include "train/step_update.h"
#include "train/stop_signal.h"

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

ClassifierTrainer::ClassifierTrainer(ClassifierRunConfig cfg, ClassifierData data, bool resume,
                                     std::unique_ptr<Comm> world)
    : cfg_(std::move(cfg)), data_(std::move(data)) {
  cfg_.validate();
  world_ = world ? std::move(world) : dist_world("classifier");
  const int W = world_->size();
  // Before the model is allocated: a config that cannot fit stops here, not in std::bad_alloc.
  check_memory(estimate_memory(cfg_.model, cfg_.train.batch_size), W > 1 ? dist_local_size() : 1,
               "this run");
  int threads = init_threads(static_cast<int>(cfg_.train.threads), W > 1 ? dist_local_size() : 1);
  const int64_t B = cfg_.train.batch_size;
  MOETRAIN_CHECK(B % W == 0,
                 "train.batch_size = {} rows cannot be split evenly over {} processes: each takes "
                 "train.batch_size / processes rows of every batch",
                 B, W);
  rows_per_rank_ = B / W;
  if (!data_.train || !data_.test) {
    ClassifierData loaded = load_classifier_data(cfg_);
    if (!data_.train) data_.train = loaded.train;
    if (!data_.test) data_.test = loaded.test;
  }
  check_dataset(*data_.train, cfg_.model, "training");
  check_dataset(*data_.test, cfg_.model, "test");
  total_steps_ = cfg_.total_steps(data_.train->n);

  // Every process holds rows of the batch, so the MoE statistics (balancing losses, capacities)
  // are reduced over all of them: the run follows the one-process run on the global batch.
  RunParallel rp =
      make_run_parallel(*world_, cfg_.dist, cfg_.model.n_experts, cfg_.model.n_layers > 0);
  model_ = std::make_unique<Classifier>(cfg_.model, rp.moe_context());
  if (cfg_.grad.expert_reweight != "none")
    reweight_ =
        std::make_unique<ExpertReweighter>(cfg_.grad.expert_reweight_config(), model_->layout());
  pg_ = std::move(rp.groups), ep_ = std::move(rp.ep), expert_shard_ = rp.experts;
  const ClassifierLayout& layout = model_->layout();
  params_.assign(static_cast<std::size_t>(layout.size()), 0.0f);
  grads_.assign(params_.size(), 0.0f);
  init_classifier_params(params_.data(), layout, cfg_.model, cfg_.train.seed);
  groups_ = param_groups(layout);
  ReduceSettings rs = reduce_settings(cfg_.dist, ep_.comm_thread.get());
  rs.sparse_experts = cfg_.grad.sparse_experts;
  DataParallel dp = make_data_parallel(layout, expert_shard_, *pg_, rs);
  if (cfg_.grad.sparse_experts && !model_->moe_layers().empty())
    sparse_ = std::make_unique<SparseExperts>(
        layout, static_cast<int64_t>(model_->moe_layers().size()), cfg_.model.n_experts, 1,
        cfg_.grad.min_accum_fraction);
  reducer_ = std::move(dp.reducer);
  optimizer_ = std::make_unique<ShardedOptimizer>(cfg_.optim.optimizer_config(), groups_,
                                                  std::move(dp.pieces));
  writers_ = checkpoint_writers(layout, pg_->layout, cfg_.model.n_experts);
  schedule_ = std::make_unique<LrSchedule>(cfg_.optim.schedule_config(total_steps_));
  sampler_ = std::make_unique<EpochSampler>(data_.train->n, cfg_.train.seed);

  rows_.resize(static_cast<std::size_t>(B));
  inputs_.resize(static_cast<std::size_t>(rows_per_rank_ * cfg_.model.input_dim));
  labels_.resize(static_cast<std::size_t>(rows_per_rank_));

  const fs::path run_dir = cfg_.train.run_dir;
  // Before anything in the run directory is read or written: a second run on it stops here.
  run_lock_ = lock_run_dir(run_dir, *pg_->control);
  if (rank() == 0) {
    // A fresh run replaces what an earlier run left in the directory, metrics and checkpoints
    // alike (checkpoints are kept by step number, so a longer old run's would outrank this one's).
    if (!resume && fs::exists(run_dir / "checkpoints")) {
      log_info("{}: removing the checkpoints of an earlier run", run_dir.string());
      fs::remove_all(run_dir / "checkpoints");
    }
  }
  pg_->control->barrier();
  const std::optional<fs::path> ckpt = checkpoint_to_resume(
      run_dir, resume, *pg_->control, [&](const fs::path& p) { load_checkpoint(p); });
  metrics_ = open_metrics(run_dir, rank(), ckpt ? std::optional<int64_t>(step_) : std::nullopt,
                          cfg_.train.tensorboard);
  if (ckpt) log_info("resumed from {} at step {}", ckpt->string(), step_);
  check_ranks_agree(*pg_->control,
                    rank_settings(cfg_.to_json(), {{"data.train_images", data_.train->n},
                                                   {"data.test_images", data_.test->n}}),
                    std::stoull(cfg_.config_hash(), nullptr, 16), step_);

  log_info(
      "classifier: {} blocks of {} experts (top-{}), C = {}, F = {}, {:.3f}M parameters; {} "
      "threads",
      cfg_.model.n_layers, cfg_.model.n_experts, cfg_.model.top_k, cfg_.model.dim,
      cfg_.model.expert_hidden, static_cast<double>(layout.size()) / 1e6, threads);
  log_info("data: {} training / {} test images; {} steps of {} ({:.2f} epochs){}", data_.train->n,
           data_.test->n, total_steps_, B,
           static_cast<double>(total_steps_ * B) / static_cast<double>(data_.train->n),
           W > 1 ? fmt::format("; {} processes: {} data-parallel x {} expert-parallel ({} experts "
                               "each){}",
                               W, pg_->layout.dp, pg_->layout.ep, expert_shard_.count,
                               cfg_.dist.zero ? ", ZeRO-1" : "")
                 : std::string());
}

ClassifierTrainer::~ClassifierTrainer() = default;

CheckpointShare ClassifierTrainer::checkpoint_share(bool reading) {
  CheckpointShare share = moetrain::checkpoint_share(
      model_->layout(), params_.data(), *optimizer_, writers_, expert_shard_, rank(),
      world_size() > 1 && cfg_.dist.zero == 1, bias_views(*model_), reading);
  if (!reading || read_carried_) add_carried_state(share, *reducer_, rank(), world_size());
  return share;
}

nlohmann::json ClassifierTrainer::trainer_state() const {
  nlohmann::json t = {{"step", step_},
          {"config_hash", cfg_.config_hash()},
          {"seed", cfg_.train.seed},
          {"optimizer", {{"name", cfg_.optim.name}, {"step_count", optimizer_->step_count()}}},
          // Batches are a pure function of (seed, step): the step says where the data stands.
          {"data",
           {{"next_step", step_},
            {"global_batch", cfg_.train.batch_size},
            {"train_rows", data_.train->n}}},
          {"layout", {{"processes", world_size()}}}};
  if (nlohmann::json r = carried_state_record(*reducer_, world_size()); !r.is_null())
    t["grad_residual"] = r;
  if (reweight_) t["expert_reweight"] = reweight_->to_json();
  return t;
}

fs::path ClassifierTrainer::save_checkpoint() {
  CheckpointDocs docs;
  docs.config = {{"model_type", "moe_classifier"},
                 {"num_labels", cfg_.model.n_classes},
                 {"input_dim", cfg_.model.input_dim},
                 {"moetrain", cfg_.to_json()}};
  docs.trainer = trainer_state();
  return write_checkpoint(*pg_->control, cfg_.train.run_dir, step_, checkpoint_share(false), docs,
                          /*keep=*/1);
}

void ClassifierTrainer::load_checkpoint(const fs::path& dir) {
  const nlohmann::json t = read_checkpoint_json(dir, "trainer_state.json");
  const std::string where = (dir / "trainer_state.json").string();
  MOETRAIN_CHECK(t.value("config_hash", std::string()) == cfg_.config_hash(),
                 "{} was written with a different configuration (hash '{}' vs this run's {}): "
                 "resume with the same model, optimizer and batch settings, or use a new "
                 "train.run_dir",
                 dir.string(), t.value("config_hash", std::string()), cfg_.config_hash());
  MOETRAIN_CHECK(t.contains("step") && t.contains("optimizer"), "{}: no 'step' or 'optimizer'",
                 where);
  reading_json(where, [&] {
    step_ = t["step"].get<int64_t>();
    optimizer_->set_step_count(t["optimizer"].value("step_count", step_));
    read_carried_ = carried_state_matches(t, *reducer_, world_size());
  });
  if (reweight_) {
    MOETRAIN_CHECK(t.contains("expert_reweight"), "{}: no 'expert_reweight'", where);
    reweight_->restore(t["expert_reweight"], where);
  }
  read_checkpoint_pieces(dir, checkpoint_share(true));
}

double ClassifierTrainer::train_step() {
  const int64_t B = cfg_.train.batch_size, D = cfg_.model.input_dim, Bl = rows_per_rank_;
  const int W = world_size();
  const ImageDataset& train = *data_.train;
  const StepCommMeter comm_meter(ep_.comm_thread.get(), *reducer_);
  sampler_->batch(step_, B, rows_.data());
  const int64_t first = rank() * Bl;  // this rank's rows of the global batch
  AccumulateArgs<ImageBatch> args;
  args.micro_batches = 1;
  // Each rank's loss is a mean over Bl rows: 1/P of it summed over ranks is the global mean.
  args.loss_weight = 1.0f / static_cast<float>(W);
  args.dropped_divisor = W;
  args.fill = [&](int64_t) {
    for (int64_t b = 0; b < Bl; ++b) {
      const int64_t row = rows_[first + b];
      std::memcpy(inputs_.data() + b * D, train.images.data() + row * D, sizeof(float) * D);
      labels_[b] = train.labels[row];
    }
    return ImageBatch{inputs_.data(), labels_.data(), Bl};
  };
  // Router noise is drawn per global row: this rank's start at `first`.
  args.moe_step = [&](int64_t) {
    return MoeStep{.seed = cfg_.train.seed,
                   .step = static_cast<uint64_t>(step_),
                   .token_offset = static_cast<uint64_t>(first)};
  };

  args.sparse = sparse_.get();
  args.before_last_backward = [&] {
    if (sparse_) {
      sparse_->agree(*pg_->control);
      reducer_->set_active_experts(sparse_->active());
    }
    reducer_->begin(grads_.data());
  };
  args.bad_loss = [&](const LossParts& p) {
    return fmt::format(
        "step {}: the loss is {} (cross-entropy {}, aux {}, z {}); stopping. Lower optim.lr or "
        "raise optim.warmup_steps",
        step_ + 1, p.total, p.ce, p.aux, p.z);
  };
  Accumulated acc =
      accumulate(*model_, params_.data(), grads_.data(), static_cast<int64_t>(grads_.size()), args);
  if (sparse_) sparse_->zero_frozen(grads_.data());
  last_lr_ = schedule_->lr(step_);
  UpdateOptions opts;
  opts.grad_clip = cfg_.optim.grad_clip;
  opts.reweight = reweight_.get();
  if (reweight_ && cfg_.grad.expert_reweight == "utilisation")
    reweight_->set_loads(reduced_loads(*pg_->control, acc));
  opts.where = fmt::format("step {}", step_ + 1);
  const std::span<const FrozenRange> frozen =
      sparse_ ? sparse_->frozen() : std::span<const FrozenRange>{};
  const StepUpdate up =
      reduce_and_update(*reducer_, *optimizer_, *pg_->control, params_.data(), grads_.data(),
                        static_cast<float>(last_lr_), opts, frozen);
  last_grad_norm_ = up.outcome.grad_norm;
  last_comm_ = comm_meter.parts(acc, up, 1.0);
  ++step_;
  StepFigures figures{.step = step_, .lr = last_lr_, .grad_norm = last_grad_norm_};
  figures.update = &up.outcome;
  figures.accuracy_rows = B;
  figures.ep = pg_->layout.ep;
  pending_metrics_ =
      finish_step(model_->moe_layers(), cfg_.model.moe(), *pg_->control, acc, figures);
  if (reweight_) {
    pending_metrics_["expert_reweight_min"] = reweight_->layer_min();
    pending_metrics_["expert_reweight_max"] = reweight_->layer_max();
  }
  stop_ = acc.stop;
  return acc.loss.total;
}

ClassifierTrainResult ClassifierTrainer::run(int64_t stop_at) {
  ClassifierTrainResult result;
  const int64_t B = cfg_.train.batch_size, eval_batch = cfg_.train.eval_batch_size;
  const int64_t first_step = step_;
  const int64_t total = stop_at >= 0 ? std::min(stop_at, total_steps_) : total_steps_;
  Progress progress(parse_progress_mode(rank() == 0 ? cfg_.train.progress : "off"), step_,
                    total_steps_);
  Timer run_timer;
  const StopSignals signals;
  // Every rank evaluates the whole test set (the replicated model gives every rank the figures).
  auto evaluate = [&] {
    ClassifierEval ev = evaluate_classifier(*model_, params_.data(), *data_.test, eval_batch);
    metrics_.write({{"step", step_}, {"test_loss", ev.loss}, {"test_accuracy", ev.accuracy}});
    return ev;
  };
  while (step_ < total) {
    Timer t;
    result.final_loss = train_step();
    fault_point("step", step_);
    const double dt = t.seconds();
    result.train_seconds += dt;
    // Timings live under their own keys so that everything else in a line is reproducible bit for
    // bit.
    pending_metrics_["step_time_s"] = dt;
    pending_metrics_["images_per_s"] = static_cast<double>(B) / dt;
    last_comm_.step_s = dt;
    add_comm_metrics(last_comm_, pending_metrics_);
    add_rank_timing(*pg_->control, {dt, comm_figures(last_comm_).compute_s}, pending_metrics_);
    metrics_.write(pending_metrics_);
    progress.update({step_, total_steps_, result.final_loss, static_cast<double>(B) / dt, last_lr_,
                     pending_metrics_["imbalance"].get<double>()});
    if (stop_.any()) {
      result.checkpoint = save_checkpoint();
      result.exit_code = stop_.exit_code();
      result.steps_done = step_ - first_step;
      result.seconds = run_timer.seconds();
      progress.finish();
      log_message(LogLevel::Warn, true, stop_message(stop_, step_, result.checkpoint.string()));
      return result;
    }
    const bool last = step_ == total;
    if (cfg_.train.eval_every > 0 && step_ % cfg_.train.eval_every == 0 && step_ < total_steps_) {
      ClassifierEval ev = evaluate();
      progress.note(fmt::format("step {}: test accuracy {:.2f}%, loss {:.4f}", step_,
                                100 * ev.accuracy, ev.loss));
    }
    if (cfg_.train.checkpoint_every > 0 && step_ % cfg_.train.checkpoint_every == 0 && !last) {
      const fs::path c = save_checkpoint();
      progress.note(fmt::format("step {}: checkpoint {}", step_, c.string()));
    }
  }
  progress.finish();
  result.steps_done = step_ - first_step;
  if (step_ < total_steps_) {
    // Stopped early, as if interrupted: a checkpoint to resume from, no final evaluation.
    result.checkpoint = save_checkpoint();
    result.seconds = run_timer.seconds();
    return result;
  }
  ClassifierEval ev = evaluate();
  result.test_loss = ev.loss;
  result.test_accuracy = ev.accuracy;
  result.checkpoint = save_checkpoint();
  result.seconds = run_timer.seconds();
  result.images_per_s = result.train_seconds > 0
                            ? static_cast<double>(B * result.steps_done) / result.train_seconds
                            : 0.0;
  log_info(
      "done: {} steps in {:.1f} s ({:.0f} images/s); test accuracy {:.2f}% ({}/{}), loss {:.4f}; "
      "checkpoint {}",
      step_, result.seconds, result.images_per_s, 100 * ev.accuracy, ev.correct, ev.n, ev.loss,
      result.checkpoint.string());
  return result;
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
