#include "train/pipeline_step.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/check.h"
#include "core/profile.h"
#include "parallel/pipeline_trace.h"

namespace moetrain {

namespace {

// Tags of the two kinds of message between neighbouring stages. Messages of one kind between two
// processes arrive in the order they were sent, and every schedule sends micro-batches' forwards
// (and backwards) in ascending order: the kind alone matches them.
constexpr int kActivationTag = 1, kGradientTag = 2;

// A stage mostly waits for a neighbour that computes: its receives poll with short sleeps
// (comm_poll_politely) instead of spinning in MPI on a core that neighbour may share.
class PoliteWaits {
 public:
  PoliteWaits() : before_(comm_polls_politely()) { comm_poll_politely(true); }
  ~PoliteWaits() { comm_poll_politely(before_); }
  PoliteWaits(const PoliteWaits&) = delete;
  PoliteWaits& operator=(const PoliteWaits&) = delete;

 private:
  bool before_;
};

}  // namespace

std::pair<int64_t, int64_t> pipe_stage_blocks(int64_t L, int64_t p, int64_t s) {
  MOETRAIN_CHECK(p >= 1 && p <= L && s >= 0 && s < p,
                 "pipeline stage {} of {} over {} blocks: needs 1 ≤ dist.pp ≤ model.n_layers", s,
                 p, L);
  const int64_t base = L / p, extra = L % p;
  const int64_t first = s * base + std::min(s, extra);
  return {first, first + base + (s < extra ? 1 : 0)};
}

PipeParams pipe_stage_params(const Transformer& model, int64_t p, int64_t s) {
  const int64_t L = model.config().n_layers;
  const auto [first, end] = pipe_stage_blocks(L, p, s);
  // Units: 0 the embedding, 1 + l block l, L + 1 the final norm and the head.
  const std::vector<int64_t> starts = model.unit_starts();
  const int64_t lo = first == 0 ? 0 : starts[static_cast<std::size_t>(1 + first)];
  const int64_t hi = end == L ? model.layout().size() : starts[static_cast<std::size_t>(1 + end)];
  return {lo, hi - lo};
}

PipelineRunner::PipelineRunner(PipeSetup setup, Transformer& model, const MoeContext& ctx)
    : setup_(std::move(setup)), ctx_(ctx) {
  MOETRAIN_CHECK(setup_.comm && setup_.comm->size() == setup_.stages &&
                     setup_.comm->rank() == setup_.stage,
                 "pipeline: stage {} of {} needs a pipe communicator of {} processes", setup_.stage,
                 setup_.stages, setup_.stages);
  const auto [first, end] =
      pipe_stage_blocks(model.config().n_layers, setup_.stages, setup_.stage);
  MOETRAIN_CHECK(model.stage_first() == first && model.stage_end() == end,
                 "pipeline stage {}: the model runs blocks [{}, {}), the stage is [{}, {})",
                 setup_.stage, model.stage_first(), model.stage_end(), first, end);
}

PipelineRunner::~PipelineRunner() = default;

int64_t PipelineRunner::slots(int64_t micro_batches) const {
  const PipeShape shape{setup_.stages, micro_batches, 1};
  int64_t live = 0, most = 0;
  for (const PipeOp& op : stage_ops(setup_.schedule, shape, setup_.stage)) {
    live += op.kind == PipeOp::Forward ? 1 : -1;
    most = std::max(most, live);
  }
  return most;
}

Transformer& PipelineRunner::slot_model(Transformer& model, int64_t k) {
  if (k == 0) return model;
  while (static_cast<int64_t>(extra_.size()) < k) {
    auto m = std::make_unique<Transformer>(model.config(), ctx_);
    m->set_precision(model.precision());
    m->set_recompute(model.recompute());
    m->set_stage(model.stage_first(), model.stage_end());
    // The reduction's buckets follow whichever slot runs the step's last backward.
    m->set_grads_ready_hook(model.grads_ready_hook());
    extra_.push_back(std::move(m));
  }
  return *extra_[static_cast<std::size_t>(k - 1)];
}

void PipelineRunner::sync_slot(Transformer& model, int64_t k) {
  if (k == 0) return;
  Transformer& m = slot_model(model, k);
  const int64_t E = model.config().n_experts;
  for (int64_t l = model.stage_first(); l < model.stage_end(); ++l) {
    const int64_t i = model.moe_index(l);
    if (i < 0) continue;
    MoeLayer& from = *model.moe_layers()[static_cast<std::size_t>(i)];
    MoeLayer& to = *m.moe_layers()[static_cast<std::size_t>(i)];
    std::copy_n(from.router_bias(), E, to.router_bias());
    to.set_capacity_factor(from.capacity_factor());
  }
}

Accumulated PipelineRunner::accumulate(Transformer& model, const float* params, float* grads,
                                       int64_t n, const AccumulateArgs<TokenBatch>& args) {
  const int64_t A = args.micro_batches, p = setup_.stages, s = setup_.stage;
  MOETRAIN_CHECK(A > 0, "accumulate: {} micro-batches, needs at least one", A);
  const bool first = s == 0, last = s == p - 1;
  Comm& pipe = *setup_.comm;
  const PoliteWaits polite;
  {
    PhaseScope zero(Phase::GradZero);
    if (args.zero_grads) {
      args.zero_grads();
    } else {
      std::fill(grads, grads + n, 0.0f);
    }
  }
  // The optimizer changed the weights since the last step: the slots' low-precision copies are
  // stale (the trainer's model is told by the step engine).
  for (auto& m : extra_) m->weights_changed();

  // Only this stage's MoE layers run here: the others' entries stay null, their figures zero.
  const std::vector<MoeLayer*> all = model.moe_layers();
  Accumulated acc = Accumulated::for_layers(all.size(), model.config().n_experts);

  // Under expert parallelism each forward and backward of a MoE layer is collective over the
  // stage's EP group (its copies in other pipelines). Every rank of that group is this stage in
  // its own pipeline and runs the same list of passes, so the exchanges of each micro-batch's
  // passes come in the same order on all of them; the pipe's sends and receives only delay a
  // pass, they never reorder one.
  const std::vector<PipeOp> ops = stage_ops(setup_.schedule, {p, A, 1}, s);
  events_.clear();
  auto now = [] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  int64_t final_backward = -1;
  for (std::size_t i = 0; i < ops.size(); ++i)
    if (ops[i].kind == PipeOp::Backward) final_backward = static_cast<int64_t>(i);
  // Slot of each micro-batch in flight; free slots; each slot's sends not yet complete (a slot's
  // output and input gradient are read by them until then).
  std::vector<int64_t> slot_of(static_cast<std::size_t>(A), -1), free;
  std::vector<std::vector<std::unique_ptr<Transfer>>> sending;
  auto settle = [&](int64_t k) {
    for (auto& t : sending[static_cast<std::size_t>(k)]) t->wait();
    sending[static_cast<std::size_t>(k)].clear();
  };
  int64_t B = 0, T = 0;
  // Under overlap, the slot whose input gradient the last backward left for the previous stage.
  const Transformer* last_send = nullptr;
  auto ensure_buffers = [&](int64_t rows) {
    const auto bytes = static_cast<std::size_t>(rows * model.config().dim);
    if (act_in_.size() < bytes) act_in_.resize(bytes), grad_in_.resize(bytes);
  };
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const PipeOp& op = ops[i];
    const auto micro = static_cast<std::size_t>(op.micro);
    if (op.kind == PipeOp::Forward) {
      const TokenBatch batch = args.fill(op.micro);
      B = batch.B, T = batch.T;
      const int64_t N = B * T, C = model.config().dim;
      int64_t k = -1;
      if (!free.empty()) {
        k = free.back(), free.pop_back();
      } else {
        k = static_cast<int64_t>(sending.size());
        sending.emplace_back();
      }
      settle(k);
      slot_of[micro] = k;
      sync_slot(model, k);
      Transformer& m = slot_model(model, k);
      const float* x = nullptr;
      if (!first) {
        ensure_buffers(N);
        PhaseScope wait(Phase::Collective);
        pipe.recv(act_in_.data(), N * C * 4, static_cast<int>(s - 1), {.tag = kActivationTag});
        x = act_in_.data();
      }
      const double start = now();
      const LossParts parts =
          m.forward(params, batch.inputs, x, batch.targets, B, T, args.moe_step(op.micro));
      events_.push_back({op, start, now()});
      MOETRAIN_CHECK(std::isfinite(parts.total), "{}", args.bad_loss(parts));
      if (!last)
        sending[static_cast<std::size_t>(k)].push_back(pipe.isend(
            m.stage_output(), N * C * 4, static_cast<int>(s + 1), {.tag = kActivationTag}));
      LossParts& sum = acc.loss;
      sum.ce += parts.ce / A, sum.aux += parts.aux / A, sum.z += parts.z / A;
      sum.total += parts.total / A;
      sum.targets += parts.targets;
      std::vector<MoeLayer*> mine(all.size(), nullptr);
      const std::vector<MoeLayer*> layers = m.moe_layers();
      for (int64_t l = m.stage_first(); l < m.stage_end(); ++l)
        if (const int64_t j = m.moe_index(l); j >= 0)
          mine[static_cast<std::size_t>(j)] = layers[static_cast<std::size_t>(j)];
      detail::accumulate_stats(mine, args.dropped_divisor, acc);
    } else {
      MOETRAIN_CHECK(op.kind == PipeOp::Backward,
                     "pipeline: the executor runs forward and backward passes (gpipe, 1f1b)");
      const int64_t k = slot_of[micro];
      MOETRAIN_CHECK(k >= 0, "pipeline: backward of micro-batch {} before its forward", op.micro);
      settle(k);
      Transformer& m = slot_model(model, k);
      const int64_t N = B * T, C = model.config().dim;
      const float* dout = nullptr;
      if (!last) {
        ensure_buffers(N);
        PhaseScope wait(Phase::Collective);
        pipe.recv(grad_in_.data(), N * C * 4, static_cast<int>(s + 1), {.tag = kGradientTag});
        dout = grad_in_.data();
      }
      const double start = now();
      if (static_cast<int64_t>(i) == final_backward && args.before_last_backward)
        args.before_last_backward();
      m.backward(params, grads, args.loss_weight, dout);
      events_.push_back({op, start, now()});
      if (!first && !(overlap_ && static_cast<int64_t>(i) == final_backward))
        sending[static_cast<std::size_t>(k)].push_back(pipe.isend(
            m.stage_input_grad(), N * C * 4, static_cast<int>(s - 1), {.tag = kGradientTag}));
      if (!first && overlap_ && static_cast<int64_t>(i) == final_backward)
        last_send = &m;
      slot_of[micro] = -1;
      free.push_back(k);
    }
  }
  const int64_t s_first = model.stage_first(), s_end = model.stage_end();
  // Every rank runs every layer's capacity controller on the step's figures summed over the
  // world, so the factor another stage's layer ran with is the one this rank's copy holds.
  for (int64_t l = 0; l < model.config().n_layers; ++l)
    if (const int64_t j = model.moe_index(l); j >= 0 && (l < s_first || l >= s_end))
      acc.capacity_factor[static_cast<std::size_t>(j)] =
          all[static_cast<std::size_t>(j)]->capacity_factor();
  // The slots' forwards counted their routing for the router-bias update: the step's counts are
  // the trainer's model's, which the step engine sums over the processes.
  for (auto& slot : extra_) {
    const std::vector<MoeLayer*> theirs = slot->moe_layers();
    for (int64_t l = model.stage_first(); l < model.stage_end(); ++l)
      if (const int64_t j = model.moe_index(l); j >= 0)
        all[static_cast<std::size_t>(j)]->take_pending_load(*theirs[static_cast<std::size_t>(j)]);
  }
  auto finish_sends = [&] {
    if (last_send)
      pipe.send(last_send->stage_input_grad(), B * T * model.config().dim * 4,
                static_cast<int>(s - 1), {.tag = kGradientTag});
    for (std::size_t k = 0; k < sending.size(); ++k) settle(static_cast<int64_t>(k));
  };
  if (overlap_) {
    PhaseScope wait(Phase::Collective);
    overlap_->wait(overlap_->post(finish_sends));
  } else {
    finish_sends();
  }
  return acc;
}

TraceFile PipelineRunner::last_step_trace(const std::string& title) {
  Comm& pipe = *setup_.comm;
  const auto p = static_cast<std::size_t>(setup_.stages);
  // Each pass as (kind, micro-batch, chunk, start, end).
  std::vector<double> mine;
  for (const PipeEvent& e : events_)
    mine.insert(mine.end(), {static_cast<double>(e.op.kind), static_cast<double>(e.op.micro),
                             static_cast<double>(e.op.chunk), e.start, e.end});
  std::vector<int64_t> counts(p, 0), displs(p, 0);
  counts[static_cast<std::size_t>(setup_.stage)] = static_cast<int64_t>(mine.size()) * 8;
  pipe.allreduce(counts.data(), static_cast<int64_t>(p));
  for (std::size_t q = 1; q < p; ++q) displs[q] = displs[q - 1] + counts[q - 1];
  std::vector<double> all(static_cast<std::size_t>((displs[p - 1] + counts[p - 1]) / 8));
  pipe.allgatherv(all.data(), counts, displs, mine.data());
  PipeTimeline tl;
  tl.stages.resize(p);
  double first = all.empty() ? 0.0 : all[3];
  for (std::size_t i = 3; i < all.size(); i += 5) first = std::min(first, all[i]);
  for (std::size_t q = 0; q < p; ++q)
    for (auto i = static_cast<std::size_t>(displs[q] / 8);
         i < static_cast<std::size_t>((displs[q] + counts[q]) / 8); i += 5) {
      PipeEvent e;
      e.op.kind = static_cast<PipeOp::Kind>(static_cast<int>(all[i]));
      e.op.micro = static_cast<int64_t>(all[i + 1]);
      e.op.chunk = static_cast<int64_t>(all[i + 2]);
      e.start = all[i + 3] - first, e.end = all[i + 4] - first;
      tl.stages[q].push_back(e);
    }
  return pipeline_trace(tl, {setup_.stages, 1, 1}, title);
}

LossParts PipelineRunner::forward_only(Transformer& model, const float* params,
                                       const int32_t* inputs, const int32_t* targets, int64_t B,
                                       int64_t T, const MoeStep& step) {
  const int64_t p = setup_.stages, s = setup_.stage, N = B * T, C = model.config().dim;
  Comm& pipe = *setup_.comm;
  const PoliteWaits polite;
  const float* x = nullptr;
  if (s > 0) {
    if (act_in_.size() < static_cast<std::size_t>(N * C)) act_in_.resize(static_cast<std::size_t>(N * C));
    pipe.recv(act_in_.data(), N * C * 4, static_cast<int>(s - 1), {.tag = kActivationTag});
    x = act_in_.data();
  }
  LossParts parts = model.forward(params, inputs, x, targets, B, T, step);
  if (s + 1 < p)
    pipe.send(model.stage_output(), N * C * 4, static_cast<int>(s + 1), {.tag = kActivationTag});
  return parts;
}

}  // namespace moetrain
