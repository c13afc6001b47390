#include "train/step_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/log.h"
#include "optim/clip.h"
#include "optim/param_groups.h"
#include "parallel/grad_sync.h"
#include "train/expert_placement.h"
#include "train/run_state.h"

namespace moetrain {

StepEngine::StepEngine(const EngineConfig& cfg, RunParallel rp, TrainableModel& model,
                       const std::function<void(float*, int64_t, int64_t)>& init_params,
                       DeviceTrainingState* device)
    : cfg_(cfg), model_(model), device_(device) {
  const std::vector<MoeLayer*> moe = model_.moe_layers();
  if (cfg_.moe.capacity == CapacityMode::Dynamic) {
    capacity_.assign(moe.size(),
                     CapacityController(cfg_.moe.balance, std::abs(cfg_.moe.capacity_factor)));
    apply_capacity_factors(capacity_, moe);
  }
  if (cfg_.moe.router_controller == RouterControllerKind::Rl) {
    for (std::size_t m = 0; m < moe.size(); ++m)
      gating_.emplace_back(cfg_.moe.gating, cfg_.moe.n_experts, cfg_.seed, m);
  }
  const ParamTable& layout = model_.param_table();
  if (cfg_.grad.expert_reweight != "none")
    reweight_ = std::make_unique<ExpertReweighter>(cfg_.grad.expert_reweight_config(), layout);
  pg_ = std::move(rp.groups), ep_ = std::move(rp.ep), expert_shard_ = rp.experts;
  tp_ = std::move(rp.tp);
  local_ = std::move(rp.local);
  tp_size_ = tp_ ? tp_->size() : 1;
  world_ = pg_->control->size();
  if (device_) device_->set_resident(true);
  set_precision(cfg_.precision);
  params_ = PageBuffer(layout.size());
  grads_ = PageBuffer(layout.size());
  // ZeRO-3 shards over the copies that sum their gradients (the world; under dist.pp a stage's
  // copies): a stage of one copy holds its parameters whole, as under ZeRO-1 and 2.
  const bool zero3 = cfg_.dist.zero == 3 && pg_->layout.world > 1;
  if (!zero3) init_params(params_.data(), 0, layout.size());
  groups_ = param_groups(layout);

  ReduceSettings rs = reduce_settings(cfg_.dist, ep_.comm_thread.get());
  rs.sparse_experts = cfg_.grad.sparse_experts;
  rs.sparse_ratio = cfg_.grad.sparse_ratio;
  rs.grad_buffer = &grads_;
  rs.copy = local_.grads.get();
  rs.replicas = local_.replicas.get();
  if (zero3) {
    rs.unit_starts = model_.unit_starts();
    MOETRAIN_CHECK(!rs.unit_starts.empty(),
                   "dist.zero = 3: this model does not split into gather units (the language "
                   "model does); use dist.zero = 2");
    MOETRAIN_CHECK(!device_, "dist.zero = 3 runs on the CPU; train.device = cuda needs dist.zero "
                             "= 0");
    rs.param_buffer = params_.data();
  }
  if (rp.pipe.comm) {
    auto* lm = dynamic_cast<Transformer*>(&model_);
    MOETRAIN_CHECK(lm, "dist.pp = {}: only the language model runs pipeline stages",
                   rp.pipe.stages);
    // The slots' MoE layers run with what the model's run with (RunParallel::moe_context).
    const MoeContext ctx = pg_->layout.world > 1 ? ep_.context(*pg_) : MoeContext{};
    pipe_ = std::make_unique<PipelineRunner>(std::move(rp.pipe), *lm, ctx);
    pipe_->set_overlap(rs.overlap);
    // The stage reduces and its optimizer steps its own parameters only: of what this rank would
    // without stages (its dense parameters and, under expert parallelism, its experts; ZeRO-1:
    // its shard of them), the part within the stage's chunks.
    rs.stage = pipe_stage_params(*lm, pipe_->stages(), pipe_->chunks_per_stage(), pipe_->stage());
  }
  DataParallel dp = make_data_parallel(layout, expert_shard_, *pg_, rs);
  zero3_ = std::move(dp.zero3);
  if (cfg_.grad.sparse_experts && !moe.empty()) {
    sparse_ = std::make_unique<SparseExperts>(layout, static_cast<int64_t>(moe.size()),
                                              cfg_.moe.n_experts, cfg_.micro_batches,
                                              cfg_.grad.min_accum_fraction);
    if (pipe_) {
      // A stage masks its own MoE layers: only its processes route tokens through them.
      const auto& lm = dynamic_cast<const Transformer&>(model_);
      const std::vector<char> blocks =
          pipe_stage_layers(lm.config().n_layers, pipe_->stages(), pipe_->chunks_per_stage(),
                            pipe_->stage());
      std::vector<uint8_t> held(moe.size(), 0);
      for (std::size_t l = 0; l < blocks.size(); ++l)
        if (const int64_t q = lm.moe_index(static_cast<int64_t>(l)); q >= 0 && blocks[l])
          held[static_cast<std::size_t>(q)] = 1;
      sparse_->hold_layers(std::move(held));
    }
  }
  reducer_ = std::move(dp.reducer);
  buckets_ = dp.buckets;
  averager_ = std::move(dp.averager);
  // A copy's checks and norm: its own (a tensor-parallel copy's: over its ranks' shards).
  if (averager_) local_comm_ = local_.check ? std::move(local_.check) : make_local_comm();
  if (cfg_.placement.enabled() && !moe.empty()) {
    const int64_t rpn = ep_.hierarchy ? ep_.hierarchy->intra->size() : cfg_.dist.ranks_per_node;
    // A communicator of its own: the exchange may run on the communication thread.
    placement_ = std::make_unique<ExpertPlacement>(cfg_.placement, model_, cfg_.moe_layer,
                                                   pg_->a2a->dup("replicas"), rpn);
    model_.set_grads_ready_hook(placement_->grads_ready(std::move(dp.grads_ready), grads_.data()));
  } else if (dp.grads_ready) {
    model_.set_grads_ready_hook(std::move(dp.grads_ready));
  }
  for (const FlatRange& r : sync_ranges(layout, expert_shard_).expert)
    own_experts_.push_back({r.offset, r.size});
  StateOffload offload;
  if (cfg_.dist.offloaded())
    offload.path = fmt::format("{}/optim-rank{}.bin", cfg_.dist.offload_path(cfg_.run_dir),
                               pg_->control->rank());
  optimizer_ = std::make_unique<ShardedOptimizer>(cfg_.optim.optimizer_config(), groups_,
                                                  std::move(dp.pieces), offload);
  writers_ = checkpoint_writers(layout, pg_->layout, cfg_.moe.n_experts);
  if (pipe_) {
    // Each stage writes its own tensors (as sharded files): the writers above are ranks of a
    // stage's copies (every stage's groups have the same layout), and copy c = replica · tp + t
    // of stage s is world rank (replica · stages + s) · tp + t (train/parallel_setup.h). So an
    // expert is written by a copy that holds it, as without stages.
    const auto& lm = dynamic_cast<const Transformer&>(model_);
    const std::vector<ParamInfo>& infos = layout.params();
    const auto P = static_cast<int>(pipe_->stages());
    const int T = tp_size_;
    for (int s = 0; s < P; ++s)
      for (const FlatRange& r : pipe_stage_params(lm, P, pipe_->chunks_per_stage(), s))
        for (std::size_t i = 0; i < infos.size(); ++i)
          if (infos[i].offset >= r.offset && infos[i].offset < r.offset + r.size)
            writers_[i] = (writers_[i] / T * P + s) * T + writers_[i] % T;
  }
  schedule_ = std::make_unique<LrSchedule>(cfg_.optim.schedule_config(cfg_.total_steps));
  if (zero3_) {
    // Every rank fills the whole model alike, a unit at a time: its shard stays, the rest goes.
    for (int64_t u = 0; u < zero3_->units(); ++u) {
      const FlatRange r = zero3_->range(u);
      init_params(params_.data(), r.offset, r.offset + r.size);
      zero3_->release(u);
    }
    model_.set_param_units(zero3_.get());
    if (pipe_) pipe_->set_param_units(zero3_.get());
  }
}

StepEngine::~StepEngine() {
  if (zero3_) model_.set_param_units(nullptr);
  if (zero3_ && pipe_) pipe_->set_param_units(nullptr);
}

void StepEngine::gather_params() {
  if (zero3_) zero3_->acquire_all();
}

std::string StepEngine::describe_layout() const {
  const ParallelLayout& pl = pg_->layout;
  if (pipe_)
    return fmt::format("{} processes: {} pipeline(s) x {} stages ({}{}){}, {} micro-batches a "
                       "step, {} activation slots on stage {}; a stage's {} copies: {} "
                       "data-parallel x {} expert-parallel ({} expert{} each){}",
                       world_, pipe_->replicas(), pipe_->stages(),
                       pipe_schedule_name(pipe_->schedule()),
                       pipe_->chunks_per_stage() > 1
                           ? fmt::format(", {} chunks a stage", pipe_->chunks_per_stage())
                           : "",
                       tp_size_ > 1 ? fmt::format(" x {} tensor-parallel ranks{}", tp_size_,
                                                  cfg_.dist.sequence_parallel
                                                      ? " (sequence-parallel)"
                                                      : "")
                                    : "",
                       cfg_.micro_batches,
                       pipe_->slots(cfg_.micro_batches), pipe_->stage(), pl.world, pl.dp, pl.ep,
                       expert_shard_.count, expert_shard_.count == 1 ? "" : "s",
                       cfg_.dist.zero ? fmt::format(", ZeRO-{} over them", cfg_.dist.zero) : "");
  return fmt::format(
      "{} processes: {}{} data-parallel x {} expert-parallel ({} expert{} each){}{}; {} gradient "
      "buckets",
      world_,
      tp_size_ > 1 ? fmt::format("{} tensor-parallel group{} of {} (each one model copy{}), "
                                 "the MoE layers over ",
                                 world_ / tp_size_, world_ / tp_size_ > 1 ? "s" : "", tp_size_,
                                 cfg_.dist.sequence_parallel ? ", sequence-parallel" : "")
                   : "",
      pl.dp, pl.ep, expert_shard_.count, expert_shard_.count == 1 ? "" : "s",
      cfg_.dist.zero ? fmt::format(", ZeRO-{}", cfg_.dist.zero) : "",
      ep_.hierarchy ? fmt::format(", {} all-to-all ({} ranks per node)",
                                  ep_.exchange->adaptive() ? "adaptive" : "2-D",
                                  ep_.hierarchy->intra->size())
                    : "",
      buckets_);
}

void StepEngine::set_precision(DType p) {
  cfg_.precision = p;
  if (p == DType::F16 && !scaler_) scaler_ = std::make_unique<LossScaler>(cfg_.loss_scale);
}

void StepEngine::host_params_changed() {
  if (zero3_) zero3_->release_all();  // every rank holds the same whole model: keep the shard
  model_.weights_changed();  // the low-precision weight copies follow the host's weights
  device_current_ = false;
}

void StepEngine::begin_step(AccumulateHooks& h, int64_t token_offset) {
  const int64_t A = cfg_.micro_batches;
  if (ep_.exchange) {
    ep_.exchange->take_cross_node_bytes();  // an evaluation's are not the step's
    ep_.exchange->begin_step(step_ + 1);    // the adaptive route's path for this step
  }
  meter_.emplace(ep_.comm_thread.get(), *reducer_);
  skipped_before_ = reducer_->bytes_skipped();  // buckets are skipped from the last backward on
  sparse_before_ = reducer_->sparse_figures();
  h.micro_batches = A;
  // The gradient of the mean over every process's micro-batches: summing the ranks' gradients
  // (the reduction) then gives the mean. Local steps: the mean over this rank's own. fp16: the
  // loss is scaled so that small gradients survive the fp16 GEMM operands.
  const int copies = averager_ ? 1 : replicas();
  const double scale = scaler_ ? scaler_->scale() : 1.0;
  h.loss_weight = static_cast<float>(scale) / static_cast<float>(A * copies);
  // Every process's MoE layers report their share (a tensor-parallel rank's, of its tokens).
  h.dropped_divisor = static_cast<double>(A * replicas() * tp_size_);
  const uint64_t seed = cfg_.seed;
  const int64_t step = step_;
  h.moe_step = [seed, step, A, token_offset](int64_t micro) {
    return micro_batch_step(seed, step, A, micro, token_offset);
  };
  if (device_) {
    // The host copies changed (a fresh or loaded run) since the device last took them.
    if (!device_current_) device_state_to_device(*device_, *optimizer_, params_.data());
    device_current_ = true;
    h.zero_grads = [this] { device_->zero_grads(); };
  } else if (reducer_->reduces_each_micro_batch()) {
    // ZeRO-2 cleared each reduced bucket: its released pages read zero and stay released.
    h.zero_grads = [this] { grads_.zero(); };
    if (A > 1) {
      h.before_backward = [this](int64_t micro) {
        reducer_->begin_micro_batch(grads_.data(), micro);
      };
      h.after_backward = [this](int64_t) { reducer_->end_micro_batch(grads_.data()); };
    }
  }
  h.sparse = sparse_.get();
  h.before_last_backward = [this] {
    // Every micro-batch is routed: the mask is known before the first bucket is posted. It is
    // agreed over the processes whose tokens the MoE layers route (moe_stats: the world, or
    // under dist.pp a stage's copies, which run the same passes; the world would wait on stages
    // still computing, which wait on this one's sends).
    if (sparse_) {
      sparse_->agree(*pg_->moe_stats);
      reducer_->set_active_experts(sparse_->active());
    }
    reducer_->begin(grads_.data());
  };
  // A step of many micro-batches (train.grad_accum) checks for a stop request between them, every
  // process agreeing; one micro-batch's step waits for the vote after it.
  if (A > 1)
    h.stop_between = [this] {
      stop_ = StopVotes::agreed(*pg_->control);
      return stop_.any();
    };
  h.bad_loss = [this](const LossParts& p) {
    return fmt::format(
        "step {}: the loss is {} (cross-entropy {}, aux {}, z {}); stopping. {}; lower optim.lr "
        "or raise optim.warmup_steps",
        step_ + 1, p.total, p.ce, p.aux, p.z, last_checkpoint_note());
  };
}

// Where a stopped run can go back to: its newest checkpoint, when it wrote one.
std::string StepEngine::last_checkpoint_note() const {
  const std::filesystem::path dir = std::filesystem::path(cfg_.run_dir) / "checkpoints";
  std::error_code ec;
  if (std::filesystem::is_directory(dir, ec) && !std::filesystem::is_empty(dir, ec))
    return fmt::format("The last good checkpoint is kept in {}", dir.string());
  return fmt::format("No checkpoint was written yet (train.run_dir = {})", cfg_.run_dir);
}

StepEngine::Update StepEngine::update(float lr, const UpdateOptions& opts) {
  Update out;
  // Local steps: each replica checks, clips and steps on its own gradients.
  Comm& comm = averager_ ? *local_comm_ : *pg_->control;
  if (device_) {
    out.outcome = check_and_clip(device_->gradient(), comm, opts);
    if (!out.outcome.skipped) {
      // AdamW on the device at the optimizer's next step, whose count the host optimizer keeps
      // (checkpoints record it).
      const int64_t t = optimizer_->step_count() + 1;
      device_->adamw_step(cfg_.optim.optimizer_config(), groups_, lr, t);
      optimizer_->set_step_count(t);
    }
    return out;
  }
  // ZeRO-1's gather changes parameters the optimizer did not write: no copy is kept then.
  const LowPrecisionCopy lp =
      reducer_->gathers_params() ? LowPrecisionCopy{} : model_.lp_copy_of(params_.data());
  const std::span<const FrozenRange> frozen =
      sparse_ ? sparse_->frozen() : std::span<const FrozenRange>{};
  const double inline_before = reducer_->inline_seconds();
  double exposed = 0;
  GradientShard* shard = nullptr;
  {
    ScopedTimer timer(exposed);
    shard = &reducer_->reduce(grads_.data());
  }
  out.outcome = check_and_clip(*shard, comm, opts);
  if (!out.outcome.skipped) {
    {
      ScopedTimer timer(exposed);
      reducer_->prepare_step(grads_.data());
    }
    if (const std::span<const float* const> pg = reducer_->piece_grads(); !pg.empty()) {
      optimizer_->step(params_.data(), pg, lr, frozen, lp);  // ZeRO-2: on the shard
    } else {
      optimizer_->step(params_.data(), grads_.data(), lr, frozen, lp);
    }
    ScopedTimer timer(exposed);  // ZeRO-1's parameter all-gather
    reducer_->finish_step(params_.data());
  }
  out.inline_s = reducer_->inline_seconds() - inline_before;
  out.blocked_s = exposed;
  // A skipped step changed nothing, so the copy stays as current as it was.
  out.lp_copy_kept = lp.data != nullptr;
  return out;
}

StepResult StepEngine::abandon_step(const Accumulated& acc) {
  meter_.reset();
  StepResult r;
  r.lr = schedule_->lr(step_);
  r.loss = acc.loss.total;
  r.abandoned_after = acc.abandoned_after;
  return r;
}

StepResult StepEngine::end_step(Accumulated& acc, const Timer& step_timer, double global_tokens,
                                int64_t accuracy_rows) {
  const int64_t A = cfg_.micro_batches;
  // Local steps under EP: this rank's experts summed the local means of the ep ranks whose tokens
  // they computed; their mean is the gradient of those tokens' mean loss.
  if (averager_ && pg_->layout.ep > 1)
    for (auto [offset, size] : own_experts_)
      scale_gradients(grads_.data() + offset, size, 1.0f / static_cast<float>(pg_->layout.ep));
  // A masked expert's accumulated gradient is discarded: nothing reads it, and the norm skips it.
  if (sparse_) sparse_->zero_frozen(grads_.data());
  StepResult r;
  r.lr = schedule_->lr(step_);
  UpdateOptions opts;
  opts.grad_clip = cfg_.optim.grad_clip;
  opts.scaler = scaler_.get();
  opts.reweight = reweight_.get();
  if (reweight_ && cfg_.grad.expert_reweight == "utilisation")
    reweight_->set_loads(reduced_loads(*pg_->control, acc));
  opts.where = fmt::format("step {}", step_ + 1);
  opts.advice = last_checkpoint_note();
  const double last_scale = opts.scaler ? opts.scaler->scale() : 1.0;
  const int64_t avg_bytes_before = averager_ ? averager_->bytes_sent() : 0;
  const Update up = update(static_cast<float>(r.lr), opts);
  r.comm = meter_->parts(acc, up.inline_s, up.blocked_s, up.outcome.skipped,
                         static_cast<double>(A));
  meter_.reset();
  // Each stage masked its own layers: the frozen count and the masked share are the whole
  // model's summed over the pipe (nothing is in flight on the communication thread now).
  if (sparse_ && pipe_) sparse_->sum_figures(pipe_->pipe_comm());
  // Masked experts' gradient computations were made and thrown away.
  if (sparse_ && !up.outcome.skipped)
    r.comm.grad_discarded += static_cast<double>(A) * sparse_->masked_share();
  if (up.outcome.skipped) {
    log_warn("step {}: fp16 gradients overflowed at loss scale {}; step skipped, scale now {}",
             step_ + 1, last_scale, scaler_->raw_scale());
  } else {
    last_grad_norm_ = up.outcome.grad_norm;
    if (up.lp_copy_kept) {
      model_.weights_changed_copy_kept();  // the optimizer rounded the weights as it wrote them
    } else if (!device_) {
      model_.weights_changed();  // a resident device stepped its own copy
    }
  }
  ++step_;
  if (averager_ && step_ % cfg_.dist.sync_every == 0) {
    // The averaging runs inline on this thread: communication nothing hides.
    const Timer averaging;
    average_replicas();
    r.comm.inline_s += averaging.seconds();
    r.comm.blocked_s += averaging.seconds();
    r.comm.bytes_grad += averager_->bytes_sent() - avg_bytes_before;
  }
  const std::vector<MoeLayer*> moe = model_.moe_layers();
  StepFigures figures{.step = step_,
                      .lr = r.lr,
                      .grad_norm = last_grad_norm_,
                      .update = &up.outcome,
                      .fp16 = scaler_ != nullptr,
                      .accuracy_rows = accuracy_rows,
                      .ep = pg_->layout.ep,
                      // Under stages every tensor-parallel rank of the last stage counts its
                      // copy's whole loss: the losses are a mean over the pipes.
                      .replicas = pipe_ ? replicas() * tp_size_ : 0};
  r.metrics = finish_step(moe, cfg_.moe_layer, *pg_->control, acc, figures,
                          capacity_.empty() ? nullptr : &capacity_,
                          {.gating = gating_.empty() ? nullptr : &gating_,
                           .step_s = step_timer.seconds(),
                           .tokens = global_tokens});
  if (sparse_) {
    r.metrics["experts_frozen"] = sparse_->inactive();
    r.metrics["bytes_grad_skipped"] = reducer_->bytes_skipped() - skipped_before_;
  }
  if (const SparseReduceFigures s = reducer_->sparse_figures(); s.values > sparse_before_.values) {
    // grad.sparse_ratio: the expert buckets' share of bytes_grad, the share of their values that
    // some rank sent, and how many ranks sent each of those on average.
    const SparseReduceFigures& b = sparse_before_;
    const auto entries = static_cast<double>(s.entries - b.entries);
    r.metrics["bytes_grad_sparse"] = s.bytes - b.bytes;
    r.metrics["grad_sparse_density"] = entries / static_cast<double>(s.values - b.values);
    r.metrics["grad_sparse_contributors"] =
        entries > 0 ? static_cast<double>(s.contributions - b.contributions) / entries : 0.0;
  }
  if (reweight_) {
    r.metrics["expert_reweight_min"] = reweight_->layer_min();
    r.metrics["expert_reweight_max"] = reweight_->layer_max();
  }
  if (placement_) {
    // The loads are the step's, over every process (finish_step reduced them).
    r.metrics["rank_max_mean_load"] = placement_->rank_max_mean_load(acc.tokens_per_expert);
    r.metrics["replicas_per_expert"] = placement_->replicas_per_expert();
    placement_->after_step(step_, acc.tokens_per_expert, params_.data());
    model_.weights_changed();
  }
  if (ep_.exchange) {
    r.metrics["a2a_cross_node_bytes"] = ep_.exchange->take_cross_node_bytes();
    if (const std::optional<RouteFigures> route = ep_.exchange->end_step()) {
      r.metrics["a2a_route"] = route->relayed;
      r.metrics["a2a_route_probe"] = route->probe ? 1 : 0;
      r.metrics["a2a_route_direct_s"] = route->direct_s;
      r.metrics["a2a_route_relayed_s"] = route->relayed_s;
      r.metrics["a2a_route_measured_s"] = route->measured_s;
      if (route->switched)
        log_info("step {}: the expert all-to-all now goes {} (per exchange: direct {:.3g} ms, "
                 "relayed {:.3g} ms)",
                 step_, route->next_relayed ? "through the 2-D route" : "direct",
                 route->direct_s * 1e3, route->relayed_s * 1e3);
    }
  }
  r.loss = acc.loss.total;
  stop_ = acc.stop;
  return r;
}

void StepEngine::average_replicas() {
  if (!averager_ || averaged_at_ == step_) return;
  double drift = averager_->average_params(params_.data());
  if (cfg_.dist.sync_moments) averager_->average_moments(*optimizer_);
  model_.weights_changed();
  averaged_at_ = step_;
  // How far the replicas had drifted apart: the largest distance of a parameter from the mean.
  pg_->control->allreduce(&drift, 1, {.op = ReduceOp::Max});
  if (metrics_) metrics_->write({{"step", step_}, {"replica_drift", drift}});
}

}  // namespace moetrain
