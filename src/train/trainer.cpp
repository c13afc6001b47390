#include "train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/fault.h"
#include "core/log.h"
#include "core/threads.h"
#include "core/timer.h"
#include "data/loader.h"
#include "data/shard.h"
#include "io/file.h"
#include "io/run_lock.h"
#include "model/device_engine.h"
#include "model/params.h"
#include "optim/clip.h"
#include "optim/device_state.h"
#include "optim/grad_reducer.h"
#include "optim/param_groups.h"
#include "optim/update.h"
#include "parallel/alltoall.h"
#include "parallel/comm_thread.h"
#include "parallel/grad_sync.h"
#include "parallel/groups.h"
#include "parallel/moe_exchange_setup.h"
#include "parallel/runtime.h"
#include "parallel/sharded_optimizer.h"
#include "train/accumulate.h"
#include "train/evaluate.h"
#include "train/expert_placement.h"
#include "train/memory_estimate.h"
#include "train/parallel_setup.h"
#include "train/precision.h"
#include "train/progress.h"
#include "train/rank_timing.h"
#include "train/run_state.h"
#include "train/step_metrics.h"
#include "train/step_update.h"
#include "train/stop_signal.h"

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
  if (cfg_.model.capacity == "dynamic") {
    capacity_.assign(model_->moe_layers().size(),
                     CapacityController(cfg_.model.balance, std::abs(cfg_.model.capacity_factor)));
    apply_capacity_factors(capacity_, model_->moe_layers());
  }
  if (parse_router_controller(cfg_.model.router_controller) == RouterControllerKind::Rl) {
    for (std::size_t m = 0; m < model_->moe_layers().size(); ++m)
      gating_.emplace_back(cfg_.model.gating, cfg_.model.n_experts, cfg_.train.seed, m);
  }
  if (cfg_.grad.expert_reweight != "none")
    reweight_ =
        std::make_unique<ExpertReweighter>(cfg_.grad.expert_reweight_config(), model_->layout());
  pg_ = std::move(rp.groups), ep_ = std::move(rp.ep), expert_shard_ = rp.experts;
  const ParallelLayout& pl = pg_->layout;
  const ExpertShard& shard = expert_shard_;
  model_->set_precision(cfg_.train.precision_dtype());
  if (cfg_.train.device != "cpu") {
    MOETRAIN_CHECK(W == 1,
                   "train.device = {} runs on one process; this run has {} (no NCCL backend yet)",
                   cfg_.train.device, W);
    model_->set_device(cfg_.train.device);
    engine_ = &model_->device_engine()->training_state();
    engine_->set_resident(true);
    const std::string& p = cfg_.train.precision;
    model_->device_engine()->set_gemm(p == "tf32"   ? DeviceGemm::TF32
                                      : p == "bf16" ? DeviceGemm::BF16
                                                    : DeviceGemm::F32);
    log_info("train.device = {}: forward, backward and update on {}", cfg_.train.device,
             model_->device_engine()->describe());
  }
  if (cfg_.train.precision_dtype() == DType::F16)
    scaler_ = std::make_unique<LossScaler>(cfg_.train.loss_scale());
  const ParamLayout& layout = model_->layout();
  params_.assign(static_cast<std::size_t>(layout.size()), 0.0f);
  grads_.assign(params_.size(), 0.0f);
  init_params(params_.data(), layout, cfg_.model, cfg_.train.seed);
  groups_ = param_groups(layout);

  ReduceSettings rs = reduce_settings(cfg_.dist, ep_.comm_thread.get());
  rs.sparse_experts = cfg_.grad.sparse_experts;
  DataParallel dp = make_data_parallel(layout, shard, *pg_, rs);
  if (cfg_.grad.sparse_experts && cfg_.model.n_moe_layers() > 0)
    sparse_ = std::make_unique<SparseExperts>(layout, cfg_.model.n_moe_layers(),
                                              cfg_.model.n_experts, cfg_.train.grad_accum,
                                              cfg_.grad.min_accum_fraction);
  reducer_ = std::move(dp.reducer);
  buckets_ = dp.buckets;
  averager_ = std::move(dp.averager);
  if (averager_) local_comm_ = make_local_comm();
  if (cfg_.placement.enabled() && cfg_.model.n_moe_layers() > 0) {
    const int64_t rpn = ep_.hierarchy ? ep_.hierarchy->intra->size() : cfg_.dist.ranks_per_node;
    // A communicator of its own: the exchange may run on the communication thread.
    placement_ = std::make_unique<ExpertPlacement>(cfg_.placement, *model_,
                                                   pg_->a2a->dup("replicas"), rpn);
    model_->set_grads_ready_hook(placement_->grads_ready(std::move(dp.grads_ready), grads_.data()));
  } else if (dp.grads_ready) {
    model_->set_grads_ready_hook(std::move(dp.grads_ready));
  }
  for (const FlatRange& r : sync_ranges(layout, shard).expert)
    own_experts_.push_back({r.offset, r.size});
  optimizer_ = std::make_unique<ShardedOptimizer>(cfg_.optim.optimizer_config(), groups_,
                                                  std::move(dp.pieces));
  writers_ = checkpoint_writers(layout, pl, cfg_.model.n_experts);

  schedule_ = std::make_unique<LrSchedule>(cfg_.optim.schedule_config(cfg_.train.steps));

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

  // Before anything in the run directory is read or written: a second run on it stops here.
  run_lock_ = lock_run_dir(cfg_.train.run_dir, *pg_->control);
  // A fresh run never overwrites (or prunes) another run's checkpoints.
  MOETRAIN_CHECK(
      resume || !fs::exists(fs::path(cfg_.train.run_dir) / "checkpoints"),
      "train.run_dir = '{}' already holds a run's checkpoints: pass --resume to continue it, or "
      "choose another train.run_dir (or remove that one)",
      cfg_.train.run_dir);
  // Collective: every rank gets the same checkpoint (or none).
  const std::optional<fs::path> ckpt = checkpoint_to_resume(
      cfg_.train.run_dir, resume, *pg_->control, [&](const fs::path& p) { load_checkpoint(p); });
  resumed_ = ckpt.has_value();
  metrics_ =
      open_metrics(cfg_.train.run_dir, pl.rank, ckpt ? std::optional<int64_t>(step_) : std::nullopt,
                   cfg_.train.tensorboard);
  if (ckpt) log_info("resumed from {} at step {}", ckpt->string(), step_);
  check_ranks_agree();
  if (pl.rank == 0)
    write_file_atomic(fs::path(cfg_.train.run_dir) / "config.json", cfg_.to_json().dump(2) + "\n");

  int64_t n_params = layout.size();
  log_info(
      "model: {} layers, {} experts (top-{}), {:.2f}M parameters, {:.1f} MFLOP/token; {} threads",
      cfg_.model.n_layers, cfg_.model.n_experts, cfg_.model.top_k,
      static_cast<double>(n_params) / 1e6, model_->flops_per_token(cfg_.train.seq_len) / 1e6,
      threads);
  log_info("data: {} train / {} val tokens; {} tokens per step", train_shard_->size(),
           val_shard_->size(), BT * cfg_.train.grad_accum * W);
  if (W > 1)
    log_info(
        "{} processes: {} data-parallel x {} expert-parallel ({} experts each){}{}; {} gradient "
        "buckets",
        W, pl.dp, pl.ep, shard.count, cfg_.dist.zero ? ", ZeRO-1" : "",
        ep_.hierarchy
            ? fmt::format(", 2-D all-to-all ({} ranks per node)", ep_.hierarchy->intra->size())
            : "",
        buckets_);
}

int Trainer::rank() const {
  return world_->rank();
}
int Trainer::world_size() const {
  return world_->size();
}

Trainer::~Trainer() = default;

double Trainer::train_step() {
  const int64_t B = cfg_.train.batch_size, T = cfg_.train.seq_len, A = cfg_.train.grad_accum;
  const int W = world_size();
  Timer step_timer;
  BatchLoader loader(*train_shard_, B, T, cfg_.train.seed, rank(), W);
  const StepCommMeter comm_meter(ep_.comm_thread.get(), *reducer_);
  // fp16: the loss is scaled so that small gradients survive the fp16 GEMM operands.
  last_scale_ = scaler_ ? scaler_->scale() : 1.0;
  last_skipped_ = false;
  AccumulateArgs<TokenBatch> args;
  args.micro_batches = A;
  // The gradient of the mean over every process's micro-batches: summing the ranks' gradients
  // (the reduction) then gives the mean. Local steps: the mean over this rank's own.
  const int replicas = averager_ ? 1 : W;
  args.loss_weight = static_cast<float>(last_scale_) / static_cast<float>(A * replicas);
  args.dropped_divisor = static_cast<double>(A * W);
  args.fill = [&](int64_t micro) {
    loader.fill(step_, micro, inputs_.data(), targets_.data());
    return TokenBatch{inputs_.data(), targets_.data(), B, T};
  };
  // Router noise is drawn per global token: this rank's rows of the batch start at rank · B · T.
  args.moe_step = [&](int64_t micro) {
    return micro_batch_step(cfg_.train.seed, step_, A, micro, rank() * B * T);
  };

  const int64_t skipped_before = reducer_->bytes_skipped();
  if (engine_) {
    // The host copies changed (a fresh or loaded run) since the engine last took them.
    if (!device_current_) device_state_to_device(*engine_, *optimizer_, params_.data());
    device_current_ = true;
    args.zero_grads = [&] { engine_->zero_grads(); };
  }
  args.sparse = sparse_.get();
  args.before_last_backward = [&] {
    // Every micro-batch is routed: the mask is known before the first bucket is posted.
    if (sparse_) {
      sparse_->agree(*pg_->control);
      reducer_->set_active_experts(sparse_->active());
    }
    reducer_->begin(grads_.data());
  };
  args.bad_loss = [&](const LossParts& p) {
    return fmt::format(
        "step {}: the loss is {} (cross-entropy {}, aux {}, z {}); stopping. The last good "
        "checkpoint is kept in {}/checkpoints; lower optim.lr or raise optim.warmup_steps",
        step_ + 1, p.total, p.ce, p.aux, p.z, cfg_.train.run_dir);
  };
  Accumulated acc =
      accumulate(*model_, params_.data(), grads_.data(), static_cast<int64_t>(grads_.size()), args);
  // Local steps under EP: this rank's experts summed the local means of the ep ranks whose tokens
  // they computed; their mean is the gradient of those tokens' mean loss.
  if (averager_ && pg_->layout.ep > 1)
    for (auto [offset, size] : own_experts_)
      scale_gradients(grads_.data() + offset, size, 1.0f / static_cast<float>(pg_->layout.ep));
  // A masked expert's accumulated gradient is discarded: nothing reads it, and the norm skips it.
  if (sparse_) sparse_->zero_frozen(grads_.data());
  last_lr_ = schedule_->lr(step_);
  UpdateOptions opts;
  opts.grad_clip = cfg_.optim.grad_clip;
  opts.scaler = scaler_.get();
  opts.reweight = reweight_.get();
  if (reweight_ && cfg_.grad.expert_reweight == "utilisation")
    reweight_->set_loads(reduced_loads(*pg_->control, acc));
  opts.where = fmt::format("step {}", step_ + 1);
  opts.advice =
      fmt::format("The last good checkpoint is kept in {}/checkpoints", cfg_.train.run_dir);
  const int64_t avg_bytes_before = averager_ ? averager_->bytes_sent() : 0;
  const std::span<const FrozenRange> frozen =
      sparse_ ? sparse_->frozen() : std::span<const FrozenRange>{};
  // Local steps: each replica checks, clips and steps on its own gradients.
  const StepUpdate up =
      engine_ ? device_update(*engine_, *optimizer_, cfg_.optim.optimizer_config(), groups_,
                              *pg_->control, static_cast<float>(last_lr_), opts)
              : reduce_and_update(*reducer_, *optimizer_,
                                  averager_ ? *local_comm_ : *pg_->control, params_.data(),
                                  grads_.data(), static_cast<float>(last_lr_), opts, frozen,
                                  model_->lp_copy_of(params_.data()));
  last_comm_ = comm_meter.parts(acc, up, static_cast<double>(A));
  // Masked experts' gradient computations were made and thrown away.
  if (sparse_ && !up.outcome.skipped)
    last_comm_.grad_discarded += static_cast<double>(A) * sparse_->masked_share();
  last_skipped_ = up.outcome.skipped;
  if (!last_skipped_) last_grad_norm_ = up.outcome.grad_norm;
  if (last_skipped_) {
    log_warn("step {}: fp16 gradients overflowed at loss scale {}; step skipped, scale now {}",
             step_ + 1, last_scale_, scaler_->raw_scale());
  } else if (up.lp_copy_kept) {
    model_->weights_changed_copy_kept();  // the optimizer rounded the weights as it wrote them
  } else if (!engine_) {
    model_->weights_changed();  // a resident engine stepped its own copy
  }
  ++step_;
  if (averager_ && step_ % cfg_.dist.sync_every == 0) {
    // The averaging runs inline on this thread: communication nothing hides.
    Timer averaging;
    average_replicas();
    last_comm_.inline_s += averaging.seconds();
    last_comm_.blocked_s += averaging.seconds();
    last_comm_.bytes_grad += averager_->bytes_sent() - avg_bytes_before;
  }
  pending_metrics_ = finish_step(model_->moe_layers(), cfg_.model.moe(), *pg_->control, acc,
                                 {.step = step_,
                                  .lr = last_lr_,
                                  .grad_norm = last_grad_norm_,
                                  .update = &up.outcome,
                                  .fp16 = scaler_ != nullptr,
                                  .ep = pg_->layout.ep},
                                 capacity_.empty() ? nullptr : &capacity_,
                                 {.gating = gating_.empty() ? nullptr : &gating_,
                                  .step_s = step_timer.seconds(),
                                  .tokens = static_cast<double>(B * T * A * W)});
  if (sparse_) {
    pending_metrics_["experts_frozen"] = sparse_->inactive();
    pending_metrics_["bytes_grad_skipped"] = reducer_->bytes_skipped() - skipped_before;
  }
  if (reweight_) {
    pending_metrics_["expert_reweight_min"] = reweight_->layer_min();
    pending_metrics_["expert_reweight_max"] = reweight_->layer_max();
  }
  if (placement_) {
    // The loads are the step's, over every process (finish_step reduced them).
    pending_metrics_["rank_max_mean_load"] = placement_->rank_max_mean_load(acc.tokens_per_expert);
    pending_metrics_["replicas_per_expert"] = placement_->replicas_per_expert();
    placement_->after_step(step_, acc.tokens_per_expert, params_.data());
    model_->weights_changed();
  }
  last_parts_ = acc.loss;
  stop_ = acc.stop;
  return acc.loss.total;
}

TrainResult Trainer::run(int64_t stop_at) {
  TrainResult result;
  result.first_step = step_;
  const int64_t total = stop_at >= 0 ? std::min(stop_at, cfg_.train.steps) : cfg_.train.steps;
  const double tokens_per_step = static_cast<double>(cfg_.train.batch_size * cfg_.train.seq_len *
                                                     cfg_.train.grad_accum * world_size());
  Progress progress(parse_progress_mode(rank() == 0 ? cfg_.train.progress : "off"), step_,
                    cfg_.train.steps);
  Timer run_timer;
  double train_seconds = 0;
  const StopSignals signals;
  while (step_ < total) {
    Timer t;
    if (ep_.exchange) ep_.exchange->take_cross_node_bytes();  // an evaluation's are not the step's
    if (cfg_.train.profile) profile::start();
    result.final_loss = train_step();
    const PhaseTable phases = cfg_.train.profile ? profile::stop() : PhaseTable{};
    fault_point("step", step_);
    double dt = t.seconds();
    train_seconds += dt;
    pending_metrics_["step_time_s"] = dt;
    pending_metrics_["tokens_per_s"] = tokens_per_step / dt;
    if (ep_.exchange) {
      pending_metrics_["a2a_cross_node_bytes"] = ep_.exchange->take_cross_node_bytes();
    }
    last_comm_.step_s = dt;
    add_comm_metrics(last_comm_, pending_metrics_);
    add_rank_timing(*pg_->control, {dt, comm_figures(last_comm_).compute_s}, pending_metrics_);
    if (cfg_.train.profile) add_rank_phases(*pg_->control, phases, dt, pending_metrics_);
    metrics_.write(pending_metrics_);
    progress.update({step_, cfg_.train.steps, result.final_loss, tokens_per_step / dt, last_lr_,
                     pending_metrics_["imbalance"].get<double>()});
    if (stop_.any()) {
      result.last_checkpoint = save_checkpoint();
      result.exit_code = stop_.exit_code();
      result.steps_done = step_ - result.first_step;
      result.seconds = run_timer.seconds();
      progress.finish();
      // Every rank says where it stopped: they agree on the step.
      log_message(LogLevel::Warn, true,
                  stop_message(stop_, step_, result.last_checkpoint.string()));
      return result;
    }
    bool last = step_ == total;
    if (cfg_.train.eval_every > 0 && step_ % cfg_.train.eval_every == 0 && !last) {
      result.val_loss = evaluate(*model_, params_.data(), *val_shard_, cfg_.train.batch_size,
                                 cfg_.train.seq_len, cfg_.train.eval_batches, pg_->control.get());
      metrics_.write({{"step", step_}, {"val_loss", result.val_loss}});
      progress.note(
          fmt::format("step {}: validation loss {:.4f} nats/byte", step_, result.val_loss));
    }
    if (cfg_.train.checkpoint_every > 0 && step_ % cfg_.train.checkpoint_every == 0 && !last) {
      result.last_checkpoint = save_checkpoint();
      progress.note(fmt::format("step {}: checkpoint {}", step_, result.last_checkpoint.string()));
    }
  }
  progress.finish();
  average_replicas();  // the final evaluation and checkpoint see one model
  result.steps_done = step_ - result.first_step;
  result.seconds = run_timer.seconds();
  result.tokens_per_s =
      train_seconds > 0 ? tokens_per_step * static_cast<double>(result.steps_done) / train_seconds
                        : 0.0;
  result.val_loss = evaluate(*model_, params_.data(), *val_shard_, cfg_.train.batch_size,
                             cfg_.train.seq_len, cfg_.train.eval_batches, pg_->control.get());
  metrics_.write({{"step", step_}, {"val_loss", result.val_loss}});
  result.last_checkpoint = save_checkpoint();
  log_info(
      "done: {} steps in {:.1f} s ({:.0f} tokens/s); validation loss {:.4f} nats/byte; checkpoint "
      "{}",
      result.steps_done, result.seconds, result.tokens_per_s, result.val_loss,
      result.last_checkpoint.string());
  return result;
}

void Trainer::average_replicas() {
  if (!averager_ || averaged_at_ == step_) return;
  double drift = averager_->average_params(params_.data());
  if (cfg_.dist.sync_moments) averager_->average_moments(*optimizer_);
  model_->weights_changed();
  averaged_at_ = step_;
  // How far the replicas had drifted apart: the largest distance of a parameter from the mean.
  pg_->control->allreduce(&drift, 1, {.op = ReduceOp::Max});
  metrics_.write({{"step", step_}, {"replica_drift", drift}});
}

}  // namespace moetrain
