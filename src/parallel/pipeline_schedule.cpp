#include "parallel/pipeline_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/check.h"

namespace moetrain {

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

bool splits_backward(PipeSchedule s) { return s == PipeSchedule::ZeroBubble; }

// The passes of every (micro, chunk) as they are scheduled: their end times (kNever: not yet).
struct Done {
  int64_t chunks = 0;
  std::vector<double> f, b, w;
  Done(int64_t m, int64_t c)
      : chunks(c),
        f(static_cast<std::size_t>(m * c), kNever),
        b(f),
        w(f) {}
  double& at(std::vector<double>& v, int64_t micro, int64_t chunk) {
    return v[static_cast<std::size_t>(micro * chunks + chunk)];
  }
};

// When pass `op` may start: its inputs' passes ended (and crossed from the other stage).
double ready_time(const PipeOp& op, Done& d, const PipeShape& shape, const PipeCosts& costs) {
  const int64_t p = shape.stages, C = shape.chunks(), c = op.chunk, i = op.micro;
  auto arrive = [&](double end, int64_t from) {
    return end == kNever ? kNever : end + (from % p == c % p ? 0.0 : costs.send);
  };
  switch (op.kind) {
    case PipeOp::Forward:
      return c == 0 ? 0.0 : arrive(d.at(d.f, i, c - 1), c - 1);
    case PipeOp::Backward: {
      const double own = d.at(d.f, i, c);
      if (c == C - 1) return own;
      return std::max(own, arrive(d.at(d.b, i, c + 1), c + 1));
    }
    case PipeOp::Weight:
      return d.at(d.b, i, c);
  }
  return kNever;
}

double cost_of(const PipeOp& op, const PipeCosts& costs, bool split) {
  switch (op.kind) {
    case PipeOp::Forward: return costs.forward;
    case PipeOp::Backward: return split ? costs.backward : costs.backward + costs.weight;
    case PipeOp::Weight: return costs.weight;
  }
  return 0;
}

std::vector<PipeOp> one_f_one_b(const PipeShape& shape, int64_t stage) {
  const int64_t p = shape.stages, m = shape.micro_batches;
  const int64_t warmup = std::min(p - stage - 1, m);
  std::vector<PipeOp> ops;
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) ops.push_back({PipeOp::Forward, f, stage});
  while (f < m) {
    ops.push_back({PipeOp::Forward, f++, stage});
    ops.push_back({PipeOp::Backward, b++, stage});
  }
  while (b < m) ops.push_back({PipeOp::Backward, b++, stage});
  return ops;
}

// Megatron's interleaved order: micro-batches go through the stage's chunks in groups of p.
// Stage s runs `interleaved_warmup` forwards before its first backward.
int64_t interleaved_warmup(const PipeShape& shape, int64_t stage) {
  const int64_t p = shape.stages, m = shape.micro_batches, vp = shape.virtual_stages;
  const int64_t total = m * vp;
  return m == p ? total : std::min((p - stage - 1) * 2 + (vp - 1) * p, total);
}

std::vector<PipeOp> interleaved(const PipeShape& shape, int64_t stage) {
  const int64_t p = shape.stages, m = shape.micro_batches, vp = shape.virtual_stages;
  const int64_t total = m * vp, group = p * vp;
  auto op = [&](PipeOp::Kind kind, int64_t k) {
    int64_t local = (k % group) / p;
    if (kind == PipeOp::Backward) local = vp - 1 - local;
    return PipeOp{kind, (k / group) * p + k % p, local * p + stage};
  };
  const int64_t warmup = interleaved_warmup(shape, stage);
  std::vector<PipeOp> ops;
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) ops.push_back(op(PipeOp::Forward, f));
  while (f < total) {
    ops.push_back(op(PipeOp::Forward, f++));
    ops.push_back(op(PipeOp::Backward, b++));
  }
  while (b < total) ops.push_back(op(PipeOp::Backward, b++));
  return ops;
}

// A list's backwards split into their input-gradient pass B, in place, and their weight pass W:
// the weight pass of the list's k-th backward right after backward k + delay, the last `delay`
// after the last backward. The weight passes keep the backwards' order, so each chunk's run in
// ascending micro-batch order as its backwards do.
std::vector<PipeOp> defer_weights(const std::vector<PipeOp>& ops, int64_t delay) {
  std::vector<PipeOp> out, backwards;
  std::size_t w = 0;
  for (const PipeOp& op : ops) {
    out.push_back(op);
    if (op.kind != PipeOp::Backward) continue;
    backwards.push_back(op);
    if (static_cast<int64_t>(backwards.size()) > delay)
      out.push_back({PipeOp::Weight, backwards[w].micro, backwards[w].chunk}), ++w;
  }
  for (; w < backwards.size(); ++w)
    out.push_back({PipeOp::Weight, backwards[w].micro, backwards[w].chunk});
  return out;
}

// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B's order with each backward's
// input-gradient pass in its place, and stage s's weight passes s micro-batches late — W(j)
// right after B(j + s), the rest after the last backward. The later stages, which would idle at
// the start of the drain, hand the input gradients back first and fill the gaps with weight
// passes; each stage holds at most p micro-batches (the first stage's count under 1F1B).
//
// With vp chunks a stage the same on the interleaved order: stage s's weight passes run as many
// backwards late as it runs fewer warm-up forwards than stage 0 (2s, or none when m = p and
// every stage runs every forward first), so each stage holds at most the chunks stage 0 holds
// under interleaved 1F1B, the schedule's activation bound unchanged.
std::vector<PipeOp> zero_bubble(const PipeShape& shape, int64_t stage) {
  if (shape.virtual_stages > 1)
    return defer_weights(interleaved(shape, stage),
                         interleaved_warmup(shape, 0) - interleaved_warmup(shape, stage));
  return defer_weights(one_f_one_b(shape, stage), stage);
}

}  // namespace

std::string_view pipe_schedule_name(PipeSchedule s) {
  switch (s) {
    case PipeSchedule::GPipe: return "gpipe";
    case PipeSchedule::OneFOneB: return "1f1b";
    case PipeSchedule::Interleaved: return "interleaved";
    case PipeSchedule::ZeroBubble: return "zero_bubble";
  }
  return "?";
}

PipeSchedule parse_pipe_schedule(std::string_view value, std::string_view key) {
  for (PipeSchedule s : {PipeSchedule::GPipe, PipeSchedule::OneFOneB, PipeSchedule::Interleaved,
                         PipeSchedule::ZeroBubble})
    if (value == pipe_schedule_name(s)) return s;
  MOETRAIN_FAIL("{} = '{}': allowed are gpipe, 1f1b, interleaved, zero_bubble", key, value);
}

std::string pipe_shape_problem(PipeSchedule s, const PipeShape& shape) {
  const int64_t p = shape.stages, m = shape.micro_batches, vp = shape.virtual_stages;
  const std::string_view name = pipe_schedule_name(s);
  if (p < 1) return fmt::format("{} pipeline stages: needs at least 1", p);
  if (m < 1) return fmt::format("train.grad_accum = {}: needs at least 1 micro-batch", m);
  if (vp < 1) return fmt::format("{} virtual stages (vp): needs at least 1", vp);
  // zero_bubble with vp > 1 runs on the interleaved order, so it takes that order's shapes.
  const bool interleaves =
      s == PipeSchedule::Interleaved || (s == PipeSchedule::ZeroBubble && vp > 1);
  if (vp > 1 && !interleaves)
    return fmt::format("{} virtual stages (vp) with the {} schedule: virtual stages are the "
                       "interleaved and zero_bubble schedules' (use one, or vp = 1)",
                       vp, name);
  if (interleaves && m % p != 0)
    return fmt::format("train.grad_accum = {} micro-batches for {} pipeline stages under the "
                       "{} schedule{}: must be a multiple of the stages",
                       m, p, name, vp > 1 ? fmt::format(" with {} virtual stages", vp) : "");
  if ((s == PipeSchedule::OneFOneB || s == PipeSchedule::ZeroBubble) && m < p)
    return fmt::format("train.grad_accum = {} micro-batches for {} pipeline stages under the {} "
                       "schedule: needs at least one micro-batch a stage; set train.grad_accum "
                       "= {} or more, or use the gpipe schedule",
                       m, p, name, p);
  return {};
}

std::vector<PipeOp> stage_ops(PipeSchedule s, const PipeShape& shape, int64_t stage) {
  const std::string problem = pipe_shape_problem(s, shape);
  MOETRAIN_CHECK(problem.empty(), "{}", problem);
  MOETRAIN_CHECK(stage >= 0 && stage < shape.stages, "pipeline stage {} of {}", stage,
                 shape.stages);
  switch (s) {
    case PipeSchedule::GPipe: {
      std::vector<PipeOp> ops;
      for (int64_t i = 0; i < shape.micro_batches; ++i) ops.push_back({PipeOp::Forward, i, stage});
      for (int64_t i = 0; i < shape.micro_batches; ++i) ops.push_back({PipeOp::Backward, i, stage});
      return ops;
    }
    case PipeSchedule::OneFOneB: return one_f_one_b(shape, stage);
    case PipeSchedule::Interleaved: return interleaved(shape, stage);
    case PipeSchedule::ZeroBubble: return zero_bubble(shape, stage);
  }
  return {};
}

double PipeTimeline::bubble() const {
  if (makespan <= 0 || idle.empty()) return 0;
  double sum = 0;
  for (double v : idle) sum += v;
  return sum / (static_cast<double>(idle.size()) * makespan);
}

PipeTimeline simulate(PipeSchedule s, const PipeShape& shape, const PipeCosts& costs) {
  std::vector<std::vector<PipeOp>> ops;
  for (int64_t st = 0; st < shape.stages; ++st) ops.push_back(stage_ops(s, shape, st));
  return simulate(ops, shape, costs, splits_backward(s));
}

PipeTimeline simulate(const std::vector<std::vector<PipeOp>>& ops, const PipeShape& shape,
                      const PipeCosts& costs, bool split) {
  const int64_t p = shape.stages;
  MOETRAIN_CHECK(static_cast<int64_t>(ops.size()) == p, "simulate: {} op lists for {} stages",
                 ops.size(), p);
  Done d(shape.micro_batches, shape.chunks());
  PipeTimeline tl;
  tl.stages.resize(ops.size());
  std::vector<std::size_t> next(ops.size(), 0);
  std::vector<double> free_at(ops.size(), 0.0);
  std::size_t left = 0;
  for (const auto& list : ops) left += list.size();
  while (left > 0) {
    int64_t best = -1;
    double best_t = kNever;
    for (int64_t s = 0; s < p; ++s) {
      const auto su = static_cast<std::size_t>(s);
      if (next[su] == ops[su].size()) continue;
      const PipeOp& op = ops[su][next[su]];
      MOETRAIN_CHECK(op.chunk % p == s && op.micro >= 0 && op.micro < shape.micro_batches &&
                         op.chunk < shape.chunks(),
                     "simulate: stage {} holds no pass of micro-batch {} on chunk {}", s,
                     op.micro, op.chunk);
      const double t = std::max(free_at[su], ready_time(op, d, shape, costs));
      if (t < best_t) best = s, best_t = t;
    }
    MOETRAIN_CHECK(best >= 0, "pipeline schedule deadlocks: every stage waits ({} passes left)",
                   left);
    const auto su = static_cast<std::size_t>(best);
    const PipeOp op = ops[su][next[su]++];
    const double end = best_t + cost_of(op, costs, split);
    free_at[su] = end;
    std::vector<double>& v = op.kind == PipeOp::Forward ? d.f : op.kind == PipeOp::Backward ? d.b
                                                                                           : d.w;
    double& slot = d.at(v, op.micro, op.chunk);
    MOETRAIN_CHECK(slot == kNever, "pipeline schedule runs a pass twice (micro-batch {}, chunk {})",
                   op.micro, op.chunk);
    slot = end;
    if (op.kind == PipeOp::Backward && !split) d.at(d.w, op.micro, op.chunk) = end;
    tl.stages[su].push_back({op, best_t, end});
    --left;
  }
  tl.idle.assign(ops.size(), 0.0);
  tl.peak_in_flight.assign(ops.size(), 0.0);
  for (std::size_t s = 0; s < ops.size(); ++s) {
    double busy = 0;
    for (const PipeEvent& e : tl.stages[s]) busy += e.end - e.start;
    if (!tl.stages[s].empty()) tl.makespan = std::max(tl.makespan, tl.stages[s].back().end);
    tl.idle[s] = busy;  // turned into idle below, once the makespan is known
    // Activations held: from a forward's start to the end of the pass that frees them.
    const PipeOp::Kind frees = split ? PipeOp::Weight : PipeOp::Backward;
    int64_t held = 0, peak = 0;
    for (const PipeEvent& e : tl.stages[s]) {
      if (e.op.kind == PipeOp::Forward) peak = std::max(peak, ++held);
      if (e.op.kind == frees) --held;
    }
    tl.peak_in_flight[s] = static_cast<double>(peak) / static_cast<double>(shape.virtual_stages);
  }
  for (double& v : tl.idle) v = tl.makespan - v;
  // Every pass of every micro-batch ran, once.
  for (std::size_t k = 0; k < d.f.size(); ++k)
    MOETRAIN_CHECK(d.f[k] != kNever && d.b[k] != kNever && d.w[k] != kNever,
                   "pipeline schedule misses a pass of micro-batch {}, chunk {}",
                   static_cast<int64_t>(k) / shape.chunks(),
                   static_cast<int64_t>(k) % shape.chunks());
  return tl;
}

}  // namespace moetrain
