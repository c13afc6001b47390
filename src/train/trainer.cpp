#include "train/trainer.h"

#include <fmt/format.h>

#include "core/check.h"
#include "core/log.h"
#include "core/resident.h"
#include "core/threads.h"
#include "data/loader.h"
#include "data/shard.h"
#include "io/file.h"
#include "io/trace_events.h"
#include "model/device_ops.h"
#include "parallel/runtime.h"
#include "train/evaluate.h"
#include "train/memory_estimate.h"
#include "train/run_state.h"

namespace fs = std::filesystem;

namespace moetrain {

namespace {

// train.device = cuda: the model's forward, backward and update on the device, whose state stays
// resident between checkpoints. Null on the CPU.
DeviceTrainingState* start_device(Transformer& model, const TrainConfig& t, int processes) {
  if (t.device == "cpu") return nullptr;
  MOETRAIN_CHECK(processes == 1,
                 "train.device = {} runs on one process; this run has {} (no NCCL backend yet)",
                 t.device, processes);
  model.set_device(t.device);
  model.device_ops()->set_gemm(device_gemm(t.precision));
  log_info("train.device = {}: forward, backward and update on {}", t.device,
           model.device_ops()->describe());
  return &model.device_ops()->training_state();
}

}  // namespace

Trainer::Trainer(RunConfig cfg, bool resume, std::unique_ptr<Comm> world) : cfg_(std::move(cfg)) {
  cfg_.validate();
  cfg_.train.resolve_precision();  // a configuration built in code (load_run_config did it)
  world_ = world ? std::move(world) : dist_world("trainer");
  const int W = world_->size();
  // Before the model is allocated: a config that cannot fit stops here, not in std::bad_alloc.
  // The process as it is now (binary, libraries, MPI) is the estimate's baseline.
  memory_ = rank_memory(cfg_.model, cfg_.train.batch_size, cfg_.train.seq_len,
                        trainer_layout(cfg_, W, resident_memory().rss));
  if (world_->rank() == 0)
    log_info("memory per rank: {:.1f} MiB estimated ({})", memory_.total() / (1024.0 * 1024.0),
             memory_.breakdown());
  check_memory(memory_, W > 1 ? dist_local_size() : 1, "this run");
  int threads = init_threads(static_cast<int>(cfg_.train.threads), W > 1 ? dist_local_size() : 1);
  RunParallel rp =
      make_run_parallel(*world_, cfg_.dist, cfg_.model.n_experts, cfg_.model.n_moe_layers() > 0);
  model_ = std::make_unique<Transformer>(cfg_.model, rp.moe_context());
  // The engine keeps the group.
  model_->set_tensor_parallel(rp.tp.get(), cfg_.dist.sequence_parallel);
  if (rp.pipe.comm) {
    // The stage's first chunk (chunk s of p·vp; the pipeline runner makes the others).
    const auto [first, end] = pipe_stage_blocks(
        cfg_.model.n_layers, rp.pipe.stages * rp.pipe.chunks_per_stage, rp.pipe.stage);
    model_->set_stage(first, end);
  }
  model_->set_precision(cfg_.train.precision_dtype());
  model_->set_recompute(cfg_.train.recompute);
  DeviceTrainingState* device = start_device(*model_, cfg_.train, W);
  EngineConfig ec = engine_config(cfg_, cfg_.train.grad_accum, cfg_.train.steps);
  ec.placement = cfg_.placement;
  ec.precision = cfg_.train.precision_dtype();
  ec.loss_scale = cfg_.train.loss_scale();
  engine_ = std::make_unique<StepEngine>(
      ec, std::move(rp), *model_,
      [&](float* p, int64_t from, int64_t to) {
        init_params(p, model_->layout(), cfg_.model, cfg_.train.seed, from, to);
      },
      device);

  tokenizer_ = data_tokenizer(cfg_.data.dir);
  TokenShards shards = open_token_shards(cfg_.data.dir, cfg_.model.vocab_size, cfg_.train.seq_len);
  train_shard_ = std::move(shards.train), val_shard_ = std::move(shards.val);
  const int64_t BT = cfg_.train.batch_size * cfg_.train.seq_len;
  inputs_.resize(static_cast<std::size_t>(BT));
  targets_.resize(static_cast<std::size_t>(BT));

  // The data's sizes: the same data.dir may hold different files on different machines.
  const RunIdentity identity{rank_settings(cfg_.to_json(), {{"data.train_tokens", train_shard_->size()},
                                                           {"data.val_tokens", val_shard_->size()}}),
                             std::stoull(cfg_.config_hash(), nullptr, 16)};
  resumed_ = open_run(*engine_, cfg_.train.run_dir, resume, EarlierRun::Refuse,
                      cfg_.train.tensorboard, [&](const fs::path& p) { load_checkpoint(p); },
                      identity, run_lock_, metrics_)
                 .has_value();
  if (rank() == 0)
    write_file_atomic(fs::path(cfg_.train.run_dir) / kRunConfigFile, cfg_.to_json().dump(2) + "\n");

  log_info(
      "model: {} layers, {} experts (top-{}), {:.2f}M parameters, {:.1f} MFLOP/token; {} threads",
      cfg_.model.n_layers, cfg_.model.n_experts, cfg_.model.top_k,
      static_cast<double>(model_->layout().size()) / 1e6,
      model_->flops_per_token(cfg_.train.seq_len) / 1e6, threads);
  const int64_t windows = WindowStream::windows_in(*train_shard_, cfg_.train.seq_len);
  log_info(
      "data: {} train / {} val tokens; {} tokens per step; an epoch is {} windows ({:.1f} steps)",
      train_shard_->size(), val_shard_->size(), BT * cfg_.train.grad_accum * data_replicas(),
      windows,
      static_cast<double>(windows) /
          static_cast<double>(cfg_.train.batch_size * cfg_.train.grad_accum * data_replicas()));
  if (W > 1) log_info("{}", engine_->describe_layout());
}

Trainer::~Trainer() = default;

StepResult Trainer::train_step() {
  const int64_t B = cfg_.train.batch_size, T = cfg_.train.seq_len, A = cfg_.train.grad_accum;
  const int W = data_replicas();
  // Kept between steps (it holds the epoch's permutation); a resume on another process count
  // changes the micro-batches per step, not the global batch.
  if (!loader_ || loader_->micro_batches() != A)
    loader_ =
        std::make_unique<BatchLoader>(*train_shard_, B, T, cfg_.train.seed, data_rank(), W, A);
  const int64_t step = engine_->step_count();
  MicroBatches<TokenBatch> batches;
  batches.fill = [&](int64_t micro) {
    loader_->fill(step, micro, inputs_.data(), targets_.data());
    return TokenBatch{inputs_.data(), targets_.data(), B, T};
  };
  batches.token_offset = data_rank() * B * T;  // this rank's rows of the global batch
  batches.global_tokens = static_cast<double>(B * T * A * W);
  return engine_->step(*model_, batches);
}

Evaluation Trainer::evaluate() {
  const double v = moetrain::evaluate(*model_, params().data(), *val_shard_,
                                      cfg_.train.batch_size, cfg_.train.seq_len,
                                      cfg_.train.eval_batches, &engine_->control(),
                                      engine_->pipeline());
  return {{{"val_loss", v}}, fmt::format("validation loss {:.4f} {}", v, kLmLossUnit)};
}

TrainResult Trainer::run(int64_t stop_at) {
  LoopSettings s = loop_settings(cfg_.train, cfg_.train.steps, stop_at);
  s.units_per_step = static_cast<double>(cfg_.train.batch_size * cfg_.train.seq_len *
                                         cfg_.train.grad_accum * data_replicas());
  s.unit = "tokens";
  TrainResult out;
  static_cast<LoopResult&>(out) = run_loop(*engine_, *this, s, metrics_);
  // A pipeline's last step, pass by pass on every stage: RUN_DIR/pipeline_trace.json, which the
  // run report draws and Perfetto opens (io/trace_events.h).
  if (PipelineRunner* pipe = engine_->pipeline()) {
    const TraceFile trace = pipe->last_step_trace(fmt::format(
        "moetrain train: {}, {} stages{}, {} micro-batches (the step ending at {})",
        pipe_schedule_name(pipe->schedule()), pipe->stages(),
        pipe->chunks_per_stage() > 1 ? fmt::format(" × {} chunks", pipe->chunks_per_stage())
                                     : "",
        cfg_.train.grad_accum,
        engine_->step_count()));
    // One writer: world rank 0 (replica 0, stage 0, tensor-parallel rank 0).
    if (rank() == 0 && !trace.spans.empty())
      write_trace(std::filesystem::path(cfg_.train.run_dir) / kPipelineTraceFile, trace);
  }
  if (!out.last_eval.is_null()) out.val_loss = out.last_eval.value("val_loss", -1.0);
  out.tokens_per_s = out.rate;
  return out;
}

}  // namespace moetrain
