#include "train/classifier_trainer.h"

#include <fmt/format.h>

#include <cstring>

#include "core/check.h"
#include "core/log.h"
#include "core/threads.h"
#include "parallel/runtime.h"
#include "train/memory_estimate.h"
#include "train/run_state.h"

namespace fs = std::filesystem;

namespace moetrain {

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
  complete_classifier_data(data_, cfg_);
  total_steps_ = cfg_.total_steps(data_.train->n);

  // Every process holds rows of the batch, so the MoE statistics (balancing losses, capacities)
  // are reduced over all of them: the run follows the one-process run on the global batch.
  RunParallel rp =
      make_run_parallel(*world_, cfg_.dist, cfg_.model.n_experts, cfg_.model.n_layers > 0);
  model_ = std::make_unique<Classifier>(cfg_.model, rp.moe_context());
  engine_ = std::make_unique<StepEngine>(
      engine_config(cfg_, 1, total_steps_), std::move(rp), *model_,
      [&](float* p, int64_t from, int64_t to) {
        init_classifier_params(p, model_->layout(), cfg_.model, cfg_.train.seed, from, to);
      });
  sampler_ = std::make_unique<EpochSampler>(data_.train->n, cfg_.train.seed);
  rows_.resize(static_cast<std::size_t>(B));
  inputs_.resize(static_cast<std::size_t>(rows_per_rank_ * cfg_.model.input_dim));
  labels_.resize(static_cast<std::size_t>(rows_per_rank_));

  open_run(*engine_, cfg_.train.run_dir, resume, EarlierRun::Replace, cfg_.train.tensorboard,
           [&](const fs::path& p) { load_checkpoint(p); },
           {rank_settings(cfg_.to_json(), {{"data.train_images", data_.train->n},
                                           {"data.test_images", data_.test->n}}),
            std::stoull(cfg_.config_hash(), nullptr, 16)},
           run_lock_, metrics_);

  log_info(
      "classifier: {} blocks of {} experts (top-{}), C = {}, F = {}, {:.3f}M parameters; {} "
      "threads",
      cfg_.model.n_layers, cfg_.model.n_experts, cfg_.model.top_k, cfg_.model.dim,
      cfg_.model.expert_hidden, static_cast<double>(model_->layout().size()) / 1e6, threads);
  log_info("data: {} training / {} test images; {} steps of {} ({:.2f} epochs)", data_.train->n,
           data_.test->n, total_steps_, B,
           static_cast<double>(total_steps_ * B) / static_cast<double>(data_.train->n));
  if (W > 1) log_info("{}", engine_->describe_layout());
}

ClassifierTrainer::~ClassifierTrainer() = default;

fs::path ClassifierTrainer::save_checkpoint() {
  const int64_t step = engine_->step_count();
  CheckpointDocs docs;
  docs.config = {{"model_type", "moe_classifier"},
                 {"num_labels", cfg_.model.n_classes},
                 {"input_dim", cfg_.model.input_dim},
                 {"moetrain", cfg_.to_json()}};
  docs.trainer = engine_->state_json();
  docs.trainer["config_hash"] = cfg_.config_hash();
  // Batches are a pure function of (seed, step): the step says where the data stands.
  docs.trainer["data"] = {{"next_step", step},
                          {"global_batch", cfg_.train.batch_size},
                          {"train_rows", data_.train->n}};
  docs.trainer["layout"] = {{"processes", world_size()}};
  return engine_->save_checkpoint(bias_views(*model_), docs, /*keep=*/1);
}

void ClassifierTrainer::load_checkpoint(const fs::path& dir) {
  engine_->load_checkpoint(
      dir, bias_views(*model_), [&](const nlohmann::json& t, const std::string& where) {
        const std::string hash = t.value("config_hash", std::string());
        MOETRAIN_CHECK(hash == cfg_.config_hash(),
                       "{} was written with a different configuration (hash '{}' vs this run's "
                       "{}): resume with the same model, optimizer and batch settings, or use a "
                       "new train.run_dir",
                       dir.string(), hash, cfg_.config_hash());
        engine_->restore_state(t, where);
      });
}

StepResult ClassifierTrainer::train_step() {
  const int64_t B = cfg_.train.batch_size, D = cfg_.model.input_dim, Bl = rows_per_rank_;
  const ImageDataset& train = *data_.train;
  sampler_->batch(engine_->step_count(), B, rows_.data());
  const int64_t first = rank() * Bl;  // this rank's rows of the global batch
  MicroBatches<ImageBatch> batches;
  batches.fill = [&](int64_t) {
    for (int64_t b = 0; b < Bl; ++b) {
      const int64_t row = rows_[first + b];
      std::memcpy(inputs_.data() + b * D, train.images.data() + row * D, sizeof(float) * D);
      labels_[b] = train.labels[row];
    }
    return ImageBatch{inputs_.data(), labels_.data(), Bl};
  };
  batches.token_offset = first;
  batches.global_tokens = static_cast<double>(B);
  batches.accuracy_rows = B;
  return engine_->step(*model_, batches);
}

Evaluation ClassifierTrainer::evaluate() {
  // Every rank evaluates the whole test set (the replicated model gives every rank the figures).
  const ClassifierEval ev =
      evaluate_classifier(*model_, params().data(), *data_.test, cfg_.train.eval_batch_size);
  return {{{"test_loss", ev.loss}, {"test_accuracy", ev.accuracy}},
          fmt::format("test accuracy {:.2f}% ({}/{}), loss {:.4f}", 100 * ev.accuracy, ev.correct,
                      ev.n, ev.loss)};
}

ClassifierTrainResult ClassifierTrainer::run(int64_t stop_at) {
  LoopSettings s = loop_settings(cfg_.train, total_steps_, stop_at);
  s.units_per_step = static_cast<double>(cfg_.train.batch_size);
  s.unit = "images";
  s.evaluate_when_stopped = false;
  ClassifierTrainResult out;
  static_cast<LoopResult&>(out) = run_loop(*engine_, *this, s, metrics_);
  if (!out.last_eval.is_null()) {
    out.test_loss = out.last_eval.value("test_loss", 0.0);
    out.test_accuracy = out.last_eval.value("test_accuracy", 0.0);
  }
  out.images_per_s = out.rate;
  return out;
}

}  // namespace moetrain
