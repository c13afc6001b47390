#include "train/pipeline_step.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/check.h"
#include "core/profile.h"
#include "parallel/pipeline_trace.h"

namespace moetrain {

namespace {

// Tags: the boundary between chunks b and b + 1 carries b's output forward (2b + 1) and the
// gradient of it back (2b + 2). Two processes may exchange both kinds over several boundaries
// (with 2 stages of 2 chunks, stage 1 sends stage 0 chunk 1's output and the input gradients of
// chunks 1 and 3), so each (boundary, kind) has a tag of its own; within one,
// messages arrive in the order they were sent, and every schedule runs a chunk's forwards (and
// its backwards) in ascending micro-batch order: the tag alone matches them.
int activation_tag(int64_t boundary) { return static_cast<int>(2 * boundary + 1); }
int gradient_tag(int64_t boundary) { return static_cast<int>(2 * boundary + 2); }

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
                 "pipeline part {} of {} over {} blocks: needs 1 ≤ dist.pp · dist.vp ≤ "
                 "model.n_layers",
                 s, p, L);
  const int64_t base = L / p, extra = L % p;
  const int64_t first = s * base + std::min(s, extra);
  return {first, first + base + (s < extra ? 1 : 0)};
}

std::vector<int64_t> pipe_stage_chunks(int64_t p, int64_t vp, int64_t s) {
  std::vector<int64_t> out;
  for (int64_t j = 0; j < vp; ++j) out.push_back(s + j * p);
  return out;
}

std::vector<char> pipe_stage_layers(int64_t L, int64_t p, int64_t vp, int64_t s) {
  std::vector<char> held(static_cast<std::size_t>(L), 0);
  for (const int64_t c : pipe_stage_chunks(p, vp, s)) {
    const auto [first, end] = pipe_stage_blocks(L, p * vp, c);
    std::fill(held.begin() + first, held.begin() + end, 1);
  }
  return held;
}

std::vector<FlatRange> pipe_stage_params(const Transformer& model, int64_t p, int64_t vp,
                                         int64_t s) {
  const int64_t L = model.config().n_layers;
  // Units: 0 the embedding, 1 + l block l, L + 1 the final norm and the head.
  const std::vector<int64_t> starts = model.unit_starts();
  std::vector<FlatRange> out;
  for (const int64_t c : pipe_stage_chunks(p, vp, s)) {
    const auto [first, end] = pipe_stage_blocks(L, p * vp, c);
    const int64_t lo = first == 0 ? 0 : starts[static_cast<std::size_t>(1 + first)];
    const int64_t hi =
        end == L ? model.layout().size() : starts[static_cast<std::size_t>(1 + end)];
    out.push_back({lo, hi - lo});
  }
  return out;
}

PipelineRunner::PipelineRunner(PipeSetup setup, Transformer& model, const MoeContext& ctx)
    : setup_(std::move(setup)), ctx_(ctx) {
  MOETRAIN_CHECK(setup_.comm && setup_.comm->size() == setup_.stages &&
                     setup_.comm->rank() == setup_.stage,
                 "pipeline: stage {} of {} needs a pipe communicator of {} processes", setup_.stage,
                 setup_.stages, setup_.stages);
  const int64_t vp = setup_.chunks_per_stage;
  MOETRAIN_CHECK(vp >= 1, "pipeline: dist.vp = {} chunks a stage, needs at least 1", vp);
  const auto [first, end] =
      pipe_stage_blocks(model.config().n_layers, setup_.stages * vp, setup_.stage);
  MOETRAIN_CHECK(model.stage_first() == first && model.stage_end() == end,
                 "pipeline stage {}: the model runs blocks [{}, {}), the stage's first chunk is "
                 "[{}, {})",
                 setup_.stage, model.stage_first(), model.stage_end(), first, end);
  const int64_t tp = setup_.tp ? setup_.tp->size() : 1;
  MOETRAIN_CHECK(model.tensor_parallel() == tp,
                 "pipeline stage {}: the model computes with {} tensor-parallel ranks, the stage "
                 "has {}",
                 setup_.stage, model.tensor_parallel(), tp);
  slots_.resize(static_cast<std::size_t>(vp));
  model.set_split_backward(splits_backward());
}

PipelineRunner::~PipelineRunner() = default;

int64_t PipelineRunner::slots(int64_t micro_batches) const {
  const int64_t p = setup_.stages, vp = setup_.chunks_per_stage;
  const PipeShape shape{p, micro_batches, vp};
  std::vector<int64_t> live(static_cast<std::size_t>(vp), 0);
  // A slot is free again after the pass that reads its activations last.
  const PipeOp::Kind frees = splits_backward() ? PipeOp::Weight : PipeOp::Backward;
  int64_t most = 0;
  for (const PipeOp& op : stage_ops(setup_.schedule, shape, setup_.stage)) {
    int64_t& n = live[static_cast<std::size_t>(op.chunk / p)];
    n += op.kind == PipeOp::Forward ? 1 : op.kind == frees ? -1 : 0;
    most = std::max(most, n);
  }
  return most;
}

int64_t PipelineRunner::slots_made() const {
  int64_t most = 0;
  for (std::size_t j = 0; j < slots_.size(); ++j)
    most = std::max(most, static_cast<int64_t>(slots_[j].size()) + (j == 0 ? 1 : 0));
  return most;
}

Transformer& PipelineRunner::slot_model(Transformer& model, int64_t j, int64_t k) {
  if (j == 0 && k == 0) return model;
  auto& chunk = slots_[static_cast<std::size_t>(j)];
  const int64_t index = j == 0 ? k - 1 : k;
  while (static_cast<int64_t>(chunk.size()) <= index) {
    const int64_t p = setup_.stages, vp = setup_.chunks_per_stage;
    const auto [first, end] =
        pipe_stage_blocks(model.config().n_layers, p * vp, setup_.stage + j * p);
    auto m = std::make_unique<Transformer>(model.config(), ctx_);
    m->set_precision(model.precision());
    m->set_recompute(model.recompute());
    m->set_stage(first, end);
    m->set_tensor_parallel(setup_.tp, model.sequence_parallel());
    m->set_split_backward(splits_backward());
    // The reduction's buckets follow whichever slot runs the step's last backward.
    m->set_grads_ready_hook(model.grads_ready_hook());
    m->set_param_units(units_);
    chunk.push_back(std::move(m));
  }
  return *chunk[static_cast<std::size_t>(index)];
}

void PipelineRunner::set_param_units(ParamUnits* units) {
  units_ = units;
  for (Transformer* m : made()) m->set_param_units(units);
}

std::vector<Transformer*> PipelineRunner::made() {
  std::vector<Transformer*> out;
  for (auto& chunk : slots_)
    for (auto& m : chunk) out.push_back(m.get());
  return out;
}

void PipelineRunner::sync_slot(Transformer& model, Transformer& slot) {
  if (&slot == &model) return;
  const int64_t E = model.config().n_experts;
  for (int64_t l = slot.stage_first(); l < slot.stage_end(); ++l) {
    const int64_t i = model.moe_index(l);
    if (i < 0) continue;
    MoeLayer& from = *model.moe_layers()[static_cast<std::size_t>(i)];
    MoeLayer& to = *slot.moe_layers()[static_cast<std::size_t>(i)];
    std::copy_n(from.router_bias(), E, to.router_bias());
    to.set_capacity_factor(from.capacity_factor());
  }
}

void PipelineRunner::send(const float* data, int64_t floats, int peer, int tag) {
  const std::size_t i = sending_.size();
  if (send_copies_.size() <= i) send_copies_.resize(i + 1);
  std::vector<float>& copy = send_copies_[i];
  copy.assign(data, data + floats);
  sending_.push_back(setup_.comm->isend(copy.data(), floats * 4, peer, {.tag = tag}));
}

Accumulated PipelineRunner::accumulate(Transformer& model, const float* params, float* grads,
                                       int64_t n, const AccumulateArgs<TokenBatch>& args) {
  const int64_t A = args.micro_batches, p = setup_.stages, s = setup_.stage;
  const int64_t vp = setup_.chunks_per_stage, chunks = p * vp;
  MOETRAIN_CHECK(A > 0, "accumulate: {} micro-batches, needs at least one", A);
  Comm& pipe = *setup_.comm;
  const PoliteWaits polite;
  {
    PhaseScope zero(Phase::GradZero);
    if (args.zero_grads) {
      args.zero_grads();
    } else if (args.sparse) {
      args.sparse->zero_grads(grads, n);
    } else {
      std::fill(grads, grads + n, 0.0f);
    }
  }
  if (args.sparse) args.sparse->start_step();
  // The optimizer changed the weights since the last step: the slots' low-precision copies are
  // stale (the trainer's model is told by the step engine).
  for (Transformer* m : made()) m->weights_changed();

  // Only this stage's MoE layers run here: the others' entries stay null, their figures zero.
  const std::vector<MoeLayer*> all = model.moe_layers();
  Accumulated acc = Accumulated::for_layers(all.size(), model.config().n_experts);

  // Under expert parallelism each forward and backward of a MoE layer is collective over the
  // stage's EP group (its copies in other pipelines). Every rank of that group is this stage in
  // its own pipeline and runs the same list of passes, so the exchanges of each micro-batch's
  // passes come in the same order on all of them; the pipe's sends and receives only delay a
  // pass, they never reorder one.
  const std::vector<PipeOp> ops = stage_ops(setup_.schedule, {p, A, vp}, s);
  events_.clear();
  sending_.clear();
  auto now = [] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  // The pass after which every gradient of the stage is final: the last backward, or under
  // zero_bubble the last weight pass (it follows every backward of the stage).
  const PipeOp::Kind finishes = splits_backward() ? PipeOp::Weight : PipeOp::Backward;
  int64_t final_backward = -1;
  for (std::size_t i = 0; i < ops.size(); ++i)
    if (ops[i].kind == finishes) final_backward = static_cast<int64_t>(i);
  // Each (micro-batch, local chunk)'s slot while in flight; each local chunk's free slots.
  std::vector<int64_t> slot_of(static_cast<std::size_t>(A * vp), -1);
  std::vector<std::vector<int64_t>> free(static_cast<std::size_t>(vp));
  std::vector<int64_t> made_of(static_cast<std::size_t>(vp), 0);
  int64_t B = 0, T = 0;
  // Under overlap, the slot whose input gradient the last backward left for the previous stage,
  // and the boundary it crosses.
  const Transformer* last_send = nullptr;
  int64_t last_boundary = 0;
  auto ensure_buffers = [&](int64_t rows) {
    const auto floats = static_cast<std::size_t>(rows * model.config().dim);
    if (act_in_.size() < floats) act_in_.resize(floats), grad_in_.resize(floats);
  };
  auto stage_of = [&](int64_t chunk) { return static_cast<int>(chunk % p); };
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const PipeOp& op = ops[i];
    const int64_t c = op.chunk, j = c / p;
    const auto at = static_cast<std::size_t>(op.micro * vp + j);
    if (op.kind == PipeOp::Forward) {
      const TokenBatch batch = args.fill(op.micro);
      B = batch.B, T = batch.T;
      const int64_t N = B * T, C = model.config().dim;
      // The boundary's rows on this rank: the same on the rank of the same t in every stage.
      const int64_t R = model.stage_rows(N);
      std::vector<int64_t>& mine_free = free[static_cast<std::size_t>(j)];
      int64_t k = -1;
      if (!mine_free.empty()) {
        k = mine_free.back(), mine_free.pop_back();
      } else {
        k = made_of[static_cast<std::size_t>(j)]++;
      }
      slot_of[at] = k;
      Transformer& m = slot_model(model, j, k);
      sync_slot(model, m);
      const float* x = nullptr;
      if (c > 0) {
        ensure_buffers(N);
        PhaseScope wait(Phase::Collective);
        pipe.recv(act_in_.data(), R * C * 4, stage_of(c - 1), {.tag = activation_tag(c - 1)});
        x = act_in_.data();
      }
      const double start = now();
      const LossParts parts =
          m.forward(params, batch.inputs, x, batch.targets, B, T, args.moe_step(op.micro));
      events_.push_back({op, start, now()});
      MOETRAIN_CHECK(std::isfinite(parts.total), "{}", args.bad_loss(parts));
      if (c + 1 < chunks) send(m.stage_output(), R * C, stage_of(c + 1), activation_tag(c));
      LossParts& sum = acc.loss;
      sum.ce += parts.ce / A, sum.aux += parts.aux / A, sum.z += parts.z / A;
      sum.total += parts.total / A;
      sum.targets += parts.targets;
      std::vector<MoeLayer*> mine(all.size(), nullptr);
      const std::vector<MoeLayer*> layers = m.moe_layers();
      for (int64_t l = m.stage_first(); l < m.stage_end(); ++l)
        if (const int64_t q = m.moe_index(l); q >= 0)
          mine[static_cast<std::size_t>(q)] = layers[static_cast<std::size_t>(q)];
      detail::accumulate_stats(mine, args.dropped_divisor, acc);
      if (args.sparse)
        for (std::size_t q = 0; q < mine.size(); ++q)
          if (mine[q])
            args.sparse->record(op.micro, static_cast<int64_t>(q),
                                mine[q]->stats().tokens_per_expert.data());
    } else if (op.kind == PipeOp::Weight) {
      // zero_bubble: the weight gradients the micro-batch's backward left in its slot.
      const int64_t k = slot_of[at];
      MOETRAIN_CHECK(k >= 0, "pipeline: weight pass of micro-batch {} on chunk {} before its "
                     "forward", op.micro, c);
      Transformer& m = slot_model(model, j, k);
      const double start = now();
      if (static_cast<int64_t>(i) == final_backward && args.before_last_backward)
        args.before_last_backward();
      m.weight_backward(grads);
      events_.push_back({op, start, now()});
      slot_of[at] = -1;
      free[static_cast<std::size_t>(j)].push_back(k);
    } else {
      const int64_t k = slot_of[at];
      MOETRAIN_CHECK(k >= 0, "pipeline: backward of micro-batch {} on chunk {} before its forward",
                     op.micro, c);
      Transformer& m = slot_model(model, j, k);
      const int64_t N = B * T, C = model.config().dim, R = model.stage_rows(N);
      const float* dout = nullptr;
      if (c + 1 < chunks) {
        ensure_buffers(N);
        PhaseScope wait(Phase::Collective);
        pipe.recv(grad_in_.data(), R * C * 4, stage_of(c + 1), {.tag = gradient_tag(c)});
        dout = grad_in_.data();
      }
      const double start = now();
      const bool final = static_cast<int64_t>(i) == final_backward;
      if (final && args.before_last_backward) args.before_last_backward();
      m.backward(params, grads, args.loss_weight, dout);
      events_.push_back({op, start, now()});
      if (c > 0 && !(overlap_ && final))
        send(m.stage_input_grad(), R * C, stage_of(c - 1), gradient_tag(c - 1));
      if (c > 0 && overlap_ && final) last_send = &m, last_boundary = c - 1;
      if (!splits_backward()) {
        slot_of[at] = -1;
        free[static_cast<std::size_t>(j)].push_back(k);
      }
    }
  }
  // The layers of this stage's chunks.
  const int64_t L = model.config().n_layers;
  const std::vector<char> held = pipe_stage_layers(L, p, vp, s);
  // Every rank runs every layer's capacity controller on the step's figures summed over the
  // world, so the factor another stage's layer ran with is the one this rank's copy holds.
  for (int64_t l = 0; l < L; ++l)
    if (const int64_t q = model.moe_index(l); q >= 0 && !held[static_cast<std::size_t>(l)])
      acc.capacity_factor[static_cast<std::size_t>(q)] =
          all[static_cast<std::size_t>(q)]->capacity_factor();
  // The slots' forwards counted their routing for the router-bias update: the step's counts are
  // the trainer's model's, which the step engine sums over the processes.
  for (Transformer* slot : made()) {
    const std::vector<MoeLayer*> theirs = slot->moe_layers();
    for (int64_t l = slot->stage_first(); l < slot->stage_end(); ++l)
      if (const int64_t q = model.moe_index(l); q >= 0)
        all[static_cast<std::size_t>(q)]->take_pending_load(*theirs[static_cast<std::size_t>(q)]);
  }
  auto finish_sends = [&] {
    if (last_send)
      pipe.send(last_send->stage_input_grad(), model.stage_rows(B * T) * model.config().dim * 4,
                stage_of(last_boundary), {.tag = gradient_tag(last_boundary)});
    for (auto& t : sending_) t->wait();
    sending_.clear();
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
  return pipeline_trace(tl, {setup_.stages, 1, setup_.chunks_per_stage}, title);
}

LossParts PipelineRunner::forward_only(Transformer& model, const float* params,
                                       const int32_t* inputs, const int32_t* targets, int64_t B,
                                       int64_t T, const MoeStep& step) {
  const int64_t p = setup_.stages, vp = setup_.chunks_per_stage, chunks = p * vp;
  const int64_t N = B * T, C = model.config().dim, R = model.stage_rows(N);
  Comm& pipe = *setup_.comm;
  const PoliteWaits polite;
  if (act_in_.size() < static_cast<std::size_t>(N * C))
    act_in_.resize(static_cast<std::size_t>(N * C)), grad_in_.resize(act_in_.size());
  // The chunks in order, each in its slot 0: a chain through the stages, so blocking sends only
  // wait for a receive that is already posted or comes next.
  LossParts sum;
  for (int64_t j = 0; j < vp; ++j) {
    const int64_t c = setup_.stage + j * p;
    Transformer& m = slot_model(model, j, 0);
    if (&m != &model) m.weights_changed();  // the optimizer stepped since its last forward
    sync_slot(model, m);
    const float* x = nullptr;
    if (c > 0) {
      pipe.recv(act_in_.data(), R * C * 4, static_cast<int>((c - 1) % p),
                {.tag = activation_tag(c - 1)});
      x = act_in_.data();
    }
    const LossParts parts = m.forward(params, inputs, x, targets, B, T, step);
    sum.ce += parts.ce, sum.aux += parts.aux, sum.z += parts.z, sum.total += parts.total;
    sum.targets += parts.targets;
    if (c + 1 < chunks)
      pipe.send(m.stage_output(), R * C * 4, static_cast<int>((c + 1) % p),
                {.tag = activation_tag(c)});
  }
  return sum;
}

}  // namespace moetrain
