// The pipeline schedules' orders, timed: the bubble of each against its closed form, the
// activations each keeps in flight, and the refusals.
#include "parallel/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <set>
#include <tuple>

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
      if (op.kind != PipeOp::Forward)
        EXPECT_TRUE(seen.count({op.kind - 1, op.micro, op.chunk})) << "a pass before its input";
    }
    const int64_t kinds = s == PipeSchedule::ZeroBubble ? 3 : 2;
    EXPECT_EQ(static_cast<int64_t>(ops.size()),
              kinds * shape.micro_batches * shape.virtual_stages);
  }
}

TEST(PipelineSchedule, EveryScheduleRunsEveryPassOnceWithoutDeadlock) {
  for (PipeSchedule s : kAll)
    for (int64_t p : {2, 3, 4})
      for (int64_t m : {4, 8, 12}) {
        const PipeShape shape{p, m, s == PipeSchedule::Interleaved ? 2 : 1};
        if (!pipe_shape_problem(s, shape).empty()) continue;
        SCOPED_TRACE(::testing::Message() << pipe_schedule_name(s) << " p " << p << " m " << m);
        expect_complete(s, shape);
        const PipeTimeline tl = simulate(s, shape, {1, 1, 1, 0.1});
        EXPECT_GT(tl.makespan, 0);
      }
}

// Equal passes and free sends: 1F1B and GPipe idle (p − 1)/(m + p − 1) of the step.
TEST(PipelineSchedule, OneFOneBBubbleIsTheClosedForm) {
  for (int64_t p : {2, 4})
    for (int64_t m : {4, 8, 16}) {
      const PipeShape shape{p, m, 1};
      const double expected = static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
      for (PipeSchedule s : {PipeSchedule::OneFOneB, PipeSchedule::GPipe}) {
        const PipeTimeline tl = simulate(s, shape, {1, 1, 1, 0});
        EXPECT_NEAR(tl.bubble(), expected, 1e-12) << pipe_schedule_name(s) << " p " << p
                                                  << " m " << m;
        // Uneven passes (a backward twice a forward) leave the same share.
        EXPECT_NEAR(simulate(s, shape, {1, 1.25, 0.75, 0}).bubble(), expected, 1e-12);
      }
    }
}

// 4 stages, 8 micro-batches: interleaving shortens the fill and drain, the split backward fills
// the drain with weight passes.
TEST(PipelineSchedule, InterleavedAndZeroBubbleIdleLess) {
  const PipeCosts costs{1, 1, 1, 0};
  const double one = simulate(PipeSchedule::OneFOneB, {4, 8, 1}, costs).bubble();
  const double inter = simulate(PipeSchedule::Interleaved, {4, 8, 2}, costs).bubble();
  const PipeTimeline zb = simulate(PipeSchedule::ZeroBubble, {4, 8, 1}, costs);
  EXPECT_NEAR(one, 3.0 / 11.0, 1e-12);
  // Megatron's interleaved bubble: (p − 1)/vp micro-batch times per stage.
  EXPECT_NEAR(inter, 1.5 / (8 + 1.5), 1e-12);
  EXPECT_LT(zb.bubble(), inter);
  // ZB-H1 with equal passes: each stage idles (p − 1)(F + B − W), a third of 1F1B's
  // (p − 1)(F + B + W).
  for (double idle : zb.idle) EXPECT_NEAR(idle, 3.0, 1e-12);
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
