#include "train/trainer.h"

#include <fmt/format.h>

#include "core/check.h"
#include "core/log.h"
#include "core/threads.h"
#include "data/loader.h"
#include "data/shard.h"
#include "io/file.h"
#include "model/device_engine.h"
#include "parallel/runtime.h"
#include "train/evaluate.h"
#include "train/memory_estimate.h"
#include "train/precision.h"
#include "train/run_state.h"

namespace fs = std::filesystem;

namespace moetrain {

namespace {

std::unique_ptr<TokenShard> open_shard(const DataConfig& data, const char* file) {
  fs::path p = fs::path(data.dir) / file;
  MOETRAIN_CHECK(fs::is_regular_file(p),
                 "data.dir = '{}' has no {}: prepare it first, e.g. `moetrain prepare --input "
                 "/usr/share/games/fortunes --out {}`",
                 data.dir, file, data.dir);
  return std::make_unique<TokenShard>(p);
}

// train.device = cuda: the model's forward, backward and update on the device, whose state stays
// resident between checkpoints. Null on the CPU.
DeviceTrainingState* start_device(Transformer& model, const TrainConfig& t, int processes) {
  if (t.device == "cpu") return nullptr;
  MOETRAIN_CHECK(processes == 1,
                 "train.device = {} runs on one process; this run has {} (no NCCL backend yet)",
                 t.device, processes);
  model.set_device(t.device);
  model.device_engine()->set_gemm(t.precision == "tf32"   ? DeviceGemm::TF32
                                  : t.precision == "bf16" ? DeviceGemm::BF16
                                                          : DeviceGemm::F32);
  log_info("train.device = {}: forward, backward and update on {}", t.device,
           model.device_engine()->describe());
  return &model.device_engine()->training_state();
}

}  // namespace

Trainer::Trainer(RunConfig cfg, bool resume, std::unique_ptr<Comm> world) : cfg_(std::move(cfg)) {
  cfg_.validate();
  auto_precision_ = cfg_.train.precision == "auto";
  if (auto_precision_ && cfg_.train.device == "cuda") {
    cfg_.train.precision = "bf16";
    log_info("train.precision = auto: bf16 (train.device = cuda: bf16 GEMMs on the tensor cores)");
  } else if (auto_precision_) {
    // Resolved once and recorded as the run's own value: config.json, the checkpoints and the
    // config hash say what the run computed, not what "auto" would pick on another machine.
    const std::string isa = onednn_cpu_isa();
    cfg_.train.precision = resolve_precision("auto", isa);
    log_info("train.precision = auto: {} (oneDNN dispatches to {}{})", cfg_.train.precision, isa,
             has_native_bf16(isa) ? ", a native bf16 matmul" : ", no native bf16 matmul");
  }
  world_ = world ? std::move(world) : dist_world("trainer");
  const int W = world_->size();
  // Before the model is allocated: a config that cannot fit stops here, not in std::bad_alloc.
  check_memory(estimate_memory(cfg_.model, cfg_.train.batch_size, cfg_.train.seq_len,
                               cfg_.train.precision_dtype() == DType::F32 ? 0 : 2),
               W > 1 ? dist_local_size() : 1, "this run");
  int threads = init_threads(static_cast<int>(cfg_.train.threads), W > 1 ? dist_local_size() : 1);
  RunParallel rp =
      make_run_parallel(*world_, cfg_.dist, cfg_.model.n_experts, cfg_.model.n_moe_layers() > 0);
  model_ = std::make_unique<Transformer>(cfg_.model, rp.moe_context());
  model_->set_precision(cfg_.train.precision_dtype());
  DeviceTrainingState* device = start_device(*model_, cfg_.train, W);
  EngineConfig ec = engine_config(cfg_, cfg_.train.grad_accum, cfg_.train.steps);
  ec.placement = cfg_.placement;
  ec.precision = cfg_.train.precision_dtype();
  ec.loss_scale = cfg_.train.loss_scale();
  engine_ = std::make_unique<StepEngine>(
      ec, std::move(rp), *model_,
      [&](float* p) { init_params(p, model_->layout(), cfg_.model, cfg_.train.seed); }, device);

  train_shard_ = open_shard(cfg_.data, "train.bin");
  val_shard_ = open_shard(cfg_.data, "val.bin");
  MOETRAIN_CHECK(train_shard_->vocab() <= static_cast<uint32_t>(cfg_.model.vocab_size),
                 "{} has vocabulary {}, larger than model.vocab_size = {}",
                 train_shard_->path().string(), train_shard_->vocab(), cfg_.model.vocab_size);
  MOETRAIN_CHECK(train_shard_->size() > static_cast<uint64_t>(cfg_.train.seq_len) + 1,
                 "{} has {} tokens, too few for train.seq_len = {}", train_shard_->path().string(),
                 train_shard_->size(), cfg_.train.seq_len);
  // Found here rather than at the first evaluation, after the training it would waste.
  MOETRAIN_CHECK(val_shard_->size() > static_cast<uint64_t>(cfg_.train.seq_len),
                 "{} has {} tokens, too few for train.seq_len = {} (validation needs at least {}; "
                 "prepare with a larger --val-fraction)",
                 val_shard_->path().string(), val_shard_->size(), cfg_.train.seq_len,
                 cfg_.train.seq_len + 1);
  const int64_t BT = cfg_.train.batch_size * cfg_.train.seq_len;
  inputs_.resize(static_cast<std::size_t>(BT));
  targets_.resize(static_cast<std::size_t>(BT));

  Comm& control = engine_->control();
  // Before anything in the run directory is read or written: a second run on it stops here.
  run_lock_ = lock_run_dir(cfg_.train.run_dir, control);
  // A fresh run never overwrites (or prunes) another run's checkpoints.
  MOETRAIN_CHECK(
      resume || !fs::exists(fs::path(cfg_.train.run_dir) / "checkpoints"),
      "train.run_dir = '{}' already holds a run's checkpoints: pass --resume to continue it, or "
      "choose another train.run_dir (or remove that one)",
      cfg_.train.run_dir);
  // Collective: every rank gets the same checkpoint (or none).
  const std::optional<fs::path> ckpt = checkpoint_to_resume(
      cfg_.train.run_dir, resume, control, [&](const fs::path& p) { load_checkpoint(p); });
  resumed_ = ckpt.has_value();
  const int64_t step = engine_->step_count();
  metrics_ = open_metrics(cfg_.train.run_dir, rank(),
                          ckpt ? std::optional<int64_t>(step) : std::nullopt,
                          cfg_.train.tensorboard);
  engine_->set_metrics(&metrics_);
  if (ckpt) log_info("resumed from {} at step {}", ckpt->string(), step);
  // The data's sizes: the same data.dir may hold different files on different machines.
  const nlohmann::json data = {{"data.train_tokens", train_shard_->size()},
                               {"data.val_tokens", val_shard_->size()}};
  check_ranks_agree(control, rank_settings(cfg_.to_json(), data),
                    std::stoull(cfg_.config_hash(), nullptr, 16), step);
  if (rank() == 0)
    write_file_atomic(fs::path(cfg_.train.run_dir) / "config.json", cfg_.to_json().dump(2) + "\n");

  const ParallelLayout& pl = engine_->groups().layout;
  log_info(
      "model: {} layers, {} experts (top-{}), {:.2f}M parameters, {:.1f} MFLOP/token; {} threads",
      cfg_.model.n_layers, cfg_.model.n_experts, cfg_.model.top_k,
      static_cast<double>(model_->layout().size()) / 1e6,
      model_->flops_per_token(cfg_.train.seq_len) / 1e6, threads);
  log_info("data: {} train / {} val tokens; {} tokens per step", train_shard_->size(),
           val_shard_->size(), BT * cfg_.train.grad_accum * W);
  const ExpertParallelSetup& ep = engine_->expert_parallel();
  if (W > 1)
    log_info(
        "{} processes: {} data-parallel x {} expert-parallel ({} experts each){}{}; {} gradient "
        "buckets",
        W, pl.dp, pl.ep, engine_->expert_shard().count, cfg_.dist.zero ? ", ZeRO-1" : "",
        ep.hierarchy
            ? fmt::format(", 2-D all-to-all ({} ranks per node)", ep.hierarchy->intra->size())
            : "",
        engine_->buckets());
}

Trainer::~Trainer() = default;

StepResult Trainer::train_step() {
  const int64_t B = cfg_.train.batch_size, T = cfg_.train.seq_len, A = cfg_.train.grad_accum;
  const int W = world_size();
  BatchLoader loader(*train_shard_, B, T, cfg_.train.seed, rank(), W);
  const int64_t step = engine_->step_count();
  MicroBatches<TokenBatch> batches;
  batches.fill = [&](int64_t micro) {
    loader.fill(step, micro, inputs_.data(), targets_.data());
    return TokenBatch{inputs_.data(), targets_.data(), B, T};
  };
  batches.token_offset = rank() * B * T;  // this rank's rows of the global batch
  batches.global_tokens = static_cast<double>(B * T * A * W);
  return engine_->step(*model_, batches);
}

Evaluation Trainer::evaluate() {
  const double v = moetrain::evaluate(*model_, params().data(), *val_shard_,
                                      cfg_.train.batch_size, cfg_.train.seq_len,
                                      cfg_.train.eval_batches, &engine_->control());
  return {{{"val_loss", v}}, fmt::format("validation loss {:.4f} nats/byte", v)};
}

TrainResult Trainer::run(int64_t stop_at) {
  LoopSettings s;
  s.total_steps = cfg_.train.steps;
  s.stop_at = stop_at;
  s.eval_every = cfg_.train.eval_every;
  s.checkpoint_every = cfg_.train.checkpoint_every;
  s.progress = cfg_.train.progress;
  s.profile = cfg_.train.profile;
  s.units_per_step = static_cast<double>(cfg_.train.batch_size * cfg_.train.seq_len *
                                         cfg_.train.grad_accum * world_size());
  s.unit = "tokens";
  const LoopResult r = run_loop(*engine_, *this, s, metrics_);
  TrainResult out;
  out.first_step = r.first_step;
  out.steps_done = r.steps_done;
  out.final_loss = r.final_loss;
  out.val_loss = r.last_eval.is_null() ? -1.0 : r.last_eval.value("val_loss", -1.0);
  out.seconds = r.seconds;
  out.tokens_per_s = r.rate;
  out.last_checkpoint = r.last_checkpoint;
  out.exit_code = r.exit_code;
  return out;
}

}  // namespace moetrain
