// The pipeline schedules' orders, timed: the bubble of each against its closed form, the
// activations each keeps in flight, and the refusals.
#include "parallel/pipeline_schedule.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "core/check.h"
#include "support/expect_error.h"

namespace moetrain {
namespace {
using testing::error_of;

constexpr PipeSchedule kAll[] = {PipeSchedule::GPipe, PipeSchedule::OneFOneB,
                                 PipeSchedule::Interleaved, PipeSchedule::ZeroBubble};

// Every pass of every micro-batch on every chunk of the stage, once; a forward before its
// backward, a backward before its weight pass.
void expect_complete(PipeSchedule s, const PipeShape& shape) {
  for (int64_t st = 0; st < shape.stages; ++st) {
    const std::vector<PipeOp> ops = stage_ops(s, shape, st);
    std::set<std::tuple<int, int64_t, int64_t>> seen;
    for (const PipeOp& op : ops) {
      EXPECT_EQ(op.chunk % shape.stages, st);
      EXPECT_TRUE(seen.insert({op.kind, op.micro, op.chunk}).second) << "a pass twice";
      if (op.kind != PipeOp::Forward) {
        EXPECT_TRUE(seen.count({op.kind - 1, op.micro, op.chunk})) << "a pass before its input";
      }
    }
    const int64_t kinds = s == PipeSchedule::ZeroBubble ? 3 : 2;
    EXPECT_EQ(static_cast<int64_t>(ops.size()),
              kinds * shape.micro_batches * shape.virtual_stages);
  }
}

// The order the stages' lists and their timeline keep between stages, or what breaks it:
// - each pass starts after its inputs ended: F(i, c) after F(i, c − 1), B(i, c) after F(i, c)
//   and B(i, c + 1), W(i, c) after B(i, c);
// - every send has its receive in the same place of its stream: a message's tag names only its
//   (chunk boundary, kind) (train/pipeline_step.cpp), so the forwards of chunk c (which send
//   on) and of chunk c + 1 (which receive) run the micro-batches in the same order, as do the
//   backwards of chunk c + 1 (which send back) and of chunk c;
// - each chunk's backwards and weight passes run in ascending micro-batch order, the order its
//   gradients accumulate in without stages.
std::string dependency_problem(const std::vector<std::vector<PipeOp>>& ops,
                               const PipeShape& shape, const PipeCosts& costs, bool split) {
  const int64_t C = shape.chunks(), m = shape.micro_batches;
  PipeTimeline tl;
  try {
    tl = simulate(ops, shape, costs, split);
  } catch (const Error& e) {
    return e.what();  // a pass whose input never comes: the lists deadlock
  }
  // (kind, micro, chunk) → the pass's start and end.
  std::map<std::tuple<int, int64_t, int64_t>, std::pair<double, double>> at;
  for (const auto& lane : tl.stages)
    for (const PipeEvent& e : lane) at[{e.op.kind, e.op.micro, e.op.chunk}] = {e.start, e.end};
  if (static_cast<int64_t>(at.size()) != (split ? 3 : 2) * m * C) return "passes missing";
  auto pass = [&](PipeOp::Kind kind, int64_t i, int64_t c) { return at.at({kind, i, c}); };
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < C; ++c) {
      const std::string where = fmt::format(" (micro-batch {}, chunk {})", i, c);
      const auto f = pass(PipeOp::Forward, i, c), b = pass(PipeOp::Backward, i, c);
      if (c > 0 && f.first < pass(PipeOp::Forward, i, c - 1).second)
        return "F before the previous chunk's F" + where;
      if (b.first < f.second) return "B before its F" + where;
      if (c + 1 < C && b.first < pass(PipeOp::Backward, i, c + 1).second)
        return "B before the next chunk's B" + where;
      if (split && pass(PipeOp::Weight, i, c).first < b.second) return "W before its B" + where;
    }
  // Each chunk's passes of one kind, micro-batches in list order.
  auto order = [&](PipeOp::Kind kind, int64_t chunk) {
    std::vector<int64_t> out;
    for (const PipeOp& op : ops[static_cast<std::size_t>(chunk % shape.stages)])
      if (op.kind == kind && op.chunk == chunk) out.push_back(op.micro);
    return out;
  };
  std::vector<int64_t> ascending(static_cast<std::size_t>(m));
  for (int64_t i = 0; i < m; ++i) ascending[static_cast<std::size_t>(i)] = i;
  for (int64_t c = 0; c < C; ++c) {
    if (c + 1 < C && order(PipeOp::Forward, c) != order(PipeOp::Forward, c + 1))
      return fmt::format("chunk {}'s sends on and chunk {}'s receives differ in order", c, c + 1);
    if (c + 1 < C && order(PipeOp::Backward, c + 1) != order(PipeOp::Backward, c))
      return fmt::format("chunk {}'s sends back and chunk {}'s receives differ in order", c + 1,
                         c);
    if (order(PipeOp::Backward, c) != ascending)
      return fmt::format("chunk {}'s backwards out of micro-batch order", c);
    if (split && order(PipeOp::Weight, c) != ascending)
      return fmt::format("chunk {}'s weight passes out of micro-batch order", c);
  }
  return {};
}

std::vector<std::vector<PipeOp>> lists(PipeSchedule s, const PipeShape& shape) {
  std::vector<std::vector<PipeOp>> ops;
  for (int64_t st = 0; st < shape.stages; ++st) ops.push_back(stage_ops(s, shape, st));
  return ops;
}

TEST(PipelineSchedule, EveryScheduleRunsEveryPassOnceWithoutDeadlock) {
  for (PipeSchedule s : kAll)
    for (int64_t p : {2, 3, 4})
      for (int64_t m : {4, 8, 12})
        for (int64_t vp : {1, 2, 3}) {
          const PipeShape shape{p, m, vp};
          if (!pipe_shape_problem(s, shape).empty() || p * vp > 8) continue;
          SCOPED_TRACE(::testing::Message() << pipe_schedule_name(s) << " p " << p << " m " << m
                                            << " vp " << vp);
          expect_complete(s, shape);
          const PipeTimeline tl = simulate(s, shape, {1, 1, 1, 0.1});
          EXPECT_GT(tl.makespan, 0);
          const bool split = s == PipeSchedule::ZeroBubble;
          for (const PipeCosts& costs : {PipeCosts{1, 1, 1, 0.1}, PipeCosts{1, 1.5, 0.5, 0}})
            EXPECT_EQ(dependency_problem(lists(s, shape), shape, costs, split), "");
        }
}

// The dependency check can fail: zero_bubble's lists on 2 stages of 2 chunks with one order
// broken at a time, each found out.
TEST(PipelineSchedule, DependencyCheckFindsABrokenOrder) {
  const PipeShape shape{2, 4, 2};
  const auto good = lists(PipeSchedule::ZeroBubble, shape);
  ASSERT_EQ(dependency_problem(good, shape, {}, true), "");
  auto swapped = [&](int64_t stage, PipeOp a, PipeOp b) {
    auto ops = good;
    std::vector<PipeOp>& list = ops[static_cast<std::size_t>(stage)];
    auto x = std::find(list.begin(), list.end(), a), y = std::find(list.begin(), list.end(), b);
    EXPECT_TRUE(x != list.end() && y != list.end());
    std::iter_swap(x, y);
    return ops;
  };
  // Stage 0 runs chunk 2's last two micro-batches' B and W passes the other way round: chunk 2
  // hands micro-batch 3's gradient back before micro-batch 2's.
  auto back = swapped(0, {PipeOp::Backward, 2, 2}, {PipeOp::Backward, 3, 2});
  std::vector<PipeOp>& list = back[0];
  std::iter_swap(std::find(list.begin(), list.end(), PipeOp{PipeOp::Weight, 2, 2}),
                 std::find(list.begin(), list.end(), PipeOp{PipeOp::Weight, 3, 2}));
  EXPECT_NE(dependency_problem(back, shape, {}, true)
                .find("chunk 2's sends back and chunk 1's receives differ in order"),
            std::string::npos);
  // Stage 1 runs its last two weight passes (chunk 1's, after every B) the other way round.
  EXPECT_NE(dependency_problem(swapped(1, {PipeOp::Weight, 2, 1}, {PipeOp::Weight, 3, 1}), shape,
                               {}, true)
                .find("chunk 1's weight passes out of micro-batch order"),
            std::string::npos);
  // A weight pass before its B (the list puts W(0, 2) right before B(0, 2)): the stage would
  // wait for itself.
  auto early = good;
  std::vector<PipeOp>& zero = early[0];
  const auto b = std::find(zero.begin(), zero.end(), PipeOp{PipeOp::Backward, 0, 2});
  const auto w = std::find(zero.begin(), zero.end(), PipeOp{PipeOp::Weight, 0, 2});
  ASSERT_TRUE(b < w);
  std::rotate(b, w, w + 1);
  EXPECT_NE(dependency_problem(early, shape, {}, true).find("deadlocks"), std::string::npos);
}

// Zero bubble on the interleaved order (vp = 2): a third of interleaved 1F1B's idle time with
// equal passes, as ZB-H1 is of 1F1B's (each stage idles (p − 1)(F + B − W) instead of
// (p − 1)(F + B + W)), lower with uneven passes and with sends; no stage holds more chunks
// than interleaved's first stage, whose count stays the schedule's activation bound.
TEST(PipelineSchedule, ZeroBubbleWithChunksIdlesLessThanInterleaved) {
  const PipeTimeline inter = simulate(PipeSchedule::Interleaved, {4, 8, 2}, {1, 1, 1, 0});
  const PipeTimeline zb = simulate(PipeSchedule::ZeroBubble, {4, 8, 2}, {1, 1, 1, 0});
  for (std::size_t s = 0; s < 4; ++s) {
    EXPECT_NEAR(inter.idle[s], 9.0, 1e-12);
    EXPECT_NEAR(zb.idle[s], 3.0, 1e-12);
    EXPECT_LE(zb.peak_in_flight[s], inter.peak_in_flight[0]);
  }
  EXPECT_EQ(zb.peak_in_flight[0], inter.peak_in_flight[0]);
  for (int64_t p : {2, 3, 4})
    for (int64_t k : {1, 2, 4})
      for (int64_t vp : {2, 3})
        for (const PipeCosts& costs : {PipeCosts{1, 1, 1, 0}, PipeCosts{1, 1.3, 0.7, 0.05},
                                       PipeCosts{1, 1, 1, 0.1}}) {
          const PipeShape shape{p, k * p, vp};
          SCOPED_TRACE(::testing::Message() << "p " << p << " m " << k * p << " vp " << vp
                                            << " send " << costs.send);
          const PipeTimeline i = simulate(PipeSchedule::Interleaved, shape, costs);
          const PipeTimeline z = simulate(PipeSchedule::ZeroBubble, shape, costs);
          EXPECT_LT(z.bubble(), i.bubble());
          for (double held : z.peak_in_flight) EXPECT_LE(held, i.peak_in_flight[0]);
        }
}

TEST(PipelineSchedule, ActivationsInFlight) {
  const int64_t p = 4, m = 8;
  const PipeCosts costs{1, 1, 1, 0.05};
  const PipeTimeline gpipe = simulate(PipeSchedule::GPipe, {p, m, 1}, costs);
  const PipeTimeline one = simulate(PipeSchedule::OneFOneB, {p, m, 1}, costs);
  const PipeTimeline zb = simulate(PipeSchedule::ZeroBubble, {p, m, 1}, costs);
  for (int64_t s = 0; s < p; ++s) {
    const auto su = static_cast<std::size_t>(s);
    EXPECT_EQ(gpipe.peak_in_flight[su], m);
    EXPECT_EQ(one.peak_in_flight[su], p - s);
    EXPECT_LE(zb.peak_in_flight[su], p);
  }
  // Interleaved: the first stage holds more than p micro-batches' chunks, fewer than GPipe.
  const PipeTimeline inter = simulate(PipeSchedule::Interleaved, {p, m, 2}, costs);
  EXPECT_GT(inter.peak_in_flight[0], p);
  EXPECT_LT(inter.peak_in_flight[0], m);
}

// One micro-batch crosses every stage twice: p forwards, p backwards and 2(p − 1) sends.
TEST(PipelineSchedule, SendsAreOnThePath) {
  const PipeTimeline tl = simulate(PipeSchedule::OneFOneB, {4, 4, 1}, {1, 2, 1, 0.5});
  EXPECT_GT(tl.makespan, 4 * 3.0 + 3 * (1 + 3.0) + 2 * 3 * 0.5 - 1e-9);
  const PipeTimeline single = simulate(PipeSchedule::GPipe, {3, 1, 1}, {1, 2, 1, 0.5});
  EXPECT_NEAR(single.makespan, 3 * 1 + 3 * 3 + 2 * 2 * 0.5, 1e-12);
}

TEST(PipelineSchedule, DeadlockIsNamed) {
  // Stage 0 waits for the backward of micro-batch 0 before running its forward.
  const std::vector<std::vector<PipeOp>> ops = {
      {{PipeOp::Backward, 0, 0}, {PipeOp::Forward, 0, 0}},
      {{PipeOp::Forward, 0, 1}, {PipeOp::Backward, 0, 1}}};
  EXPECT_NE(error_of([&] { simulate(ops, {2, 1, 1}, {}, false); }).find("deadlocks"),
            std::string::npos);
}

TEST(PipelineSchedule, RefusesShapesNamingTheKey) {
  EXPECT_NE(pipe_shape_problem(PipeSchedule::OneFOneB, {4, 2, 1})
                .find("train.grad_accum = 2 micro-batches for 4 pipeline stages under the 1f1b"),
            std::string::npos);
  EXPECT_NE(pipe_shape_problem(PipeSchedule::OneFOneB, {2, 4, 2}).find("2 virtual stages"),
            std::string::npos);
  EXPECT_NE(pipe_shape_problem(PipeSchedule::GPipe, {2, 4, 2}).find("2 virtual stages"),
            std::string::npos);
  // zero_bubble with chunks takes the interleaved order's shapes.
  EXPECT_TRUE(pipe_shape_problem(PipeSchedule::ZeroBubble, {2, 4, 2}).empty());
  EXPECT_NE(pipe_shape_problem(PipeSchedule::ZeroBubble, {4, 6, 2}).find("multiple"),
            std::string::npos);
  EXPECT_TRUE(pipe_shape_problem(PipeSchedule::ZeroBubble, {4, 6, 1}).empty());
  EXPECT_NE(pipe_shape_problem(PipeSchedule::Interleaved, {4, 6, 2}).find("multiple"),
            std::string::npos);
  EXPECT_TRUE(pipe_shape_problem(PipeSchedule::GPipe, {4, 2, 1}).empty());
  EXPECT_NE(error_of([] { parse_pipe_schedule("zb", "--pp-schedule"); })
                .find("--pp-schedule = 'zb': allowed are gpipe, 1f1b, interleaved, zero_bubble"),
            std::string::npos);
  EXPECT_EQ(parse_pipe_schedule("zero_bubble", "--pp-schedule"), PipeSchedule::ZeroBubble);
  EXPECT_NE(error_of([] { stage_ops(PipeSchedule::OneFOneB, {4, 2, 1}, 0); })
                .find("train.grad_accum"),
            std::string::npos);
}

}  // namespace
}  // namespace moetrain
