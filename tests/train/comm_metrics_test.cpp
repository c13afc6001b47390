// The communication figures of a step (train/step_metrics.h) from its measured parts.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "train/step_metrics.h"

using namespace moetrain;

TEST(CommFigures, OverlappedCommunication) {
  // 0.3 s on the communication thread and 0.1 s inline; the compute thread was blocked 0.15 s.
  const CommFigures f =
      comm_figures({.step_s = 1.0, .thread_s = 0.3, .inline_s = 0.1, .blocked_s = 0.15});
  EXPECT_DOUBLE_EQ(f.total_s, 0.4);
  EXPECT_DOUBLE_EQ(f.exposed_s, 0.15);
  EXPECT_DOUBLE_EQ(f.compute_s, 0.85);
  EXPECT_DOUBLE_EQ(f.comm_efficiency, 0.85 / 1.0);
  EXPECT_DOUBLE_EQ(f.overlap_ratio, 1.0 - 0.15 / 0.4);
  EXPECT_DOUBLE_EQ(f.grad_accum_efficiency, 1.0);
}

TEST(CommFigures, InlineCommunicationIsAllExposed) {
  // No communication thread: the compute thread's blocked time wraps its own calls, so it is at
  // least the inline time; the excess (bookkeeping around the calls) is not communication.
  const CommFigures f = comm_figures({.step_s = 2.0, .inline_s = 0.5, .blocked_s = 0.5004});
  EXPECT_EQ(f.exposed_s, f.total_s);
  EXPECT_EQ(f.overlap_ratio, 0.0);
  EXPECT_DOUBLE_EQ(f.compute_s, 1.5);
  EXPECT_DOUBLE_EQ(f.comm_efficiency, 0.75);
}

TEST(CommFigures, NothingCommunicated) {
  const CommFigures f = comm_figures({.step_s = 0.2});
  EXPECT_EQ(f.total_s, 0.0);
  EXPECT_EQ(f.exposed_s, 0.0);
  EXPECT_EQ(f.overlap_ratio, 1.0);
  EXPECT_EQ(f.comm_efficiency, 1.0);
  EXPECT_DOUBLE_EQ(f.compute_s, 0.2);
  const CommFigures empty = comm_figures({});
  EXPECT_EQ(empty.comm_efficiency, 1.0);
}

TEST(CommFigures, GradAccumulationEfficiency) {
  // A skipped fp16 step discards all 4 micro-batches; a hook discarding 1 of 4 leaves 0.75.
  EXPECT_EQ(comm_figures({.grad_computations = 4, .grad_discarded = 4}).grad_accum_efficiency, 0.0);
  EXPECT_DOUBLE_EQ(
      comm_figures({.grad_computations = 4, .grad_discarded = 1}).grad_accum_efficiency, 0.75);
  EXPECT_EQ(comm_figures({.grad_computations = 0}).grad_accum_efficiency, 1.0);
}

TEST(CommFigures, MetricsLineKeys) {
  nlohmann::json line = {{"step", 3}};
  add_comm_metrics({.step_s = 1.0,
                    .thread_s = 0.2,
                    .inline_s = 0.2,
                    .blocked_s = 0.1,
                    .bytes_a2a = 4096,
                    .bytes_grad = 1 << 20,
                    .grad_computations = 2},
                   line);
  EXPECT_DOUBLE_EQ(line["comm_total_s"].get<double>(), 0.4);
  EXPECT_DOUBLE_EQ(line["comm_exposed_s"].get<double>(), 0.1);
  EXPECT_DOUBLE_EQ(line["compute_s"].get<double>(), 0.9);
  EXPECT_EQ(line["bytes_a2a"].get<int64_t>(), 4096);
  EXPECT_EQ(line["bytes_grad"].get<int64_t>(), 1 << 20);
  EXPECT_DOUBLE_EQ(line["comm_efficiency"].get<double>(), 0.9);
  EXPECT_DOUBLE_EQ(line["overlap_ratio"].get<double>(), 0.75);
  EXPECT_EQ(line["grad_accum_efficiency"].get<double>(), 1.0);
}
