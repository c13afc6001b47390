#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <string>

#include "core/check.h"
#include "optim/schedule.h"
#include "support/expect_error.h"

using namespace moetrain;

namespace {

ScheduleConfig make(ScheduleKind kind, double lr, double min_lr, int64_t warmup, int64_t total,
                    double init = 0.0) {
  ScheduleConfig c;
  c.kind = kind;
  c.lr = lr;
  c.min_lr = min_lr;
  c.warmup_init = init;
  c.warmup_steps = warmup;
  c.total_steps = total;
  return c;
}

void expect_error_mentions(const ScheduleConfig& c, const std::string& needle) {
  moetrain::testing::expect_error([&] { LrSchedule s(c); }, needle.c_str());
}

}  // namespace

TEST(LrSchedule, CosineKeySteps) {
  LrSchedule s(make(ScheduleKind::Cosine, 1e-3, 1e-4, 100, 1100));
  EXPECT_DOUBLE_EQ(s.lr(0), 0.0);
  EXPECT_DOUBLE_EQ(s.lr(1), 1e-5);
  EXPECT_DOUBLE_EQ(s.lr(50), 5e-4);
  EXPECT_DOUBLE_EQ(s.lr(99), 9.9e-4);
  EXPECT_DOUBLE_EQ(s.lr(100), 1e-3);               // warmup end: peak
  EXPECT_DOUBLE_EQ(s.lr(600), 1e-4 + 0.5 * 9e-4);  // midway: cos(π/2) = 0
  EXPECT_DOUBLE_EQ(s.lr(350), 1e-4 + 9e-4 * 0.5 * (1 + std::cos(std::numbers::pi / 4)));
  EXPECT_DOUBLE_EQ(s.lr(1099), 1e-4 + 9e-4 * 0.5 * (1 + std::cos(std::numbers::pi * 0.999)));
  EXPECT_DOUBLE_EQ(s.lr(1100), 1e-4);  // total: min_lr
  EXPECT_DOUBLE_EQ(s.lr(5000), 1e-4);  // beyond: stays
  double prev = s.lr(100);
  for (int64_t t = 101; t <= 1100; ++t) {
    EXPECT_LE(s.lr(t), prev) << "cosine decay must not increase at step " << t;
    prev = s.lr(t);
  }
}

TEST(LrSchedule, WarmupInitAndNoWarmup) {
  LrSchedule s(make(ScheduleKind::Cosine, 2.0, 0.0, 4, 8, 1.0));
  EXPECT_DOUBLE_EQ(s.lr(0), 1.0);
  EXPECT_DOUBLE_EQ(s.lr(2), 1.5);
  EXPECT_DOUBLE_EQ(s.lr(4), 2.0);
  EXPECT_DOUBLE_EQ(s.lr(6), 1.0);
  EXPECT_DOUBLE_EQ(s.lr(8), 0.0);
  LrSchedule none(make(ScheduleKind::Cosine, 2.0, 0.5, 0, 10));
  EXPECT_DOUBLE_EQ(none.lr(0), 2.0);
  EXPECT_DOUBLE_EQ(none.lr(5), 1.25);
  EXPECT_DOUBLE_EQ(none.lr(10), 0.5);
  // warmup == total: warmup, then min_lr at once.
  LrSchedule edge(make(ScheduleKind::Linear, 1.0, 0.1, 5, 5));
  EXPECT_DOUBLE_EQ(edge.lr(4), 0.8);
  EXPECT_DOUBLE_EQ(edge.lr(5), 0.1);
}

TEST(LrSchedule, LinearAndConstant) {
  LrSchedule lin(make(ScheduleKind::Linear, 1e-2, 1e-3, 10, 110));
  EXPECT_DOUBLE_EQ(lin.lr(0), 0.0);
  EXPECT_DOUBLE_EQ(lin.lr(5), 5e-3);
  EXPECT_DOUBLE_EQ(lin.lr(10), 1e-2);
  EXPECT_DOUBLE_EQ(lin.lr(60), 1e-2 - 0.5 * 9e-3);
  EXPECT_DOUBLE_EQ(lin.lr(85), 1e-2 - 0.75 * 9e-3);
  EXPECT_DOUBLE_EQ(lin.lr(110), 1e-3);
  EXPECT_DOUBLE_EQ(lin.lr(1000), 1e-3);
  LrSchedule constant(make(ScheduleKind::Constant, 3e-4, 0.0, 10, 0));
  EXPECT_DOUBLE_EQ(constant.lr(0), 0.0);
  EXPECT_DOUBLE_EQ(constant.lr(5), 1.5e-4);
  EXPECT_DOUBLE_EQ(constant.lr(10), 3e-4);
  EXPECT_DOUBLE_EQ(constant.lr(1000000), 3e-4);
}

TEST(LrSchedule, ParsesNames) {
  EXPECT_EQ(parse_schedule_kind("cosine"), ScheduleKind::Cosine);
  EXPECT_EQ(parse_schedule_kind("linear"), ScheduleKind::Linear);
  EXPECT_EQ(parse_schedule_kind("constant"), ScheduleKind::Constant);
  for (auto k : {ScheduleKind::Cosine, ScheduleKind::Linear, ScheduleKind::Constant}) {
    EXPECT_EQ(parse_schedule_kind(schedule_kind_name(k)), k);
  }
  try {
    parse_schedule_kind("step");
    ADD_FAILURE() << "no error for 'step'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("constant, cosine, linear"), std::string::npos);
  }
}

TEST(LrSchedule, BadConfigsNameTheField) {
  expect_error_mentions(make(ScheduleKind::Cosine, -1e-3, 0, 0, 10), "lr = -0.001");
  expect_error_mentions(make(ScheduleKind::Cosine, NAN, 0, 0, 10), "lr = nan");
  expect_error_mentions(make(ScheduleKind::Cosine, 1e-3, 2e-3, 0, 10), "min_lr = 0.002");
  expect_error_mentions(make(ScheduleKind::Cosine, 1e-3, -1, 0, 10), "min_lr = -1");
  expect_error_mentions(make(ScheduleKind::Cosine, 1e-3, 0, 20, 10), "warmup_steps = 20");
  expect_error_mentions(make(ScheduleKind::Linear, 1e-3, 0, -1, 10), "warmup_steps = -1");
  expect_error_mentions(make(ScheduleKind::Cosine, 1e-3, 0, 0, -5), "total_steps = -5");
  expect_error_mentions(make(ScheduleKind::Cosine, 1e-3, 0, 0, 10, 2e-3), "warmup_init = 0.002");
  EXPECT_NO_THROW(LrSchedule(make(ScheduleKind::Constant, 1e-3, 0, 20, 10)));
  LrSchedule s(make(ScheduleKind::Constant, 1e-3, 0, 0, 0));
  EXPECT_THROW(s.lr(-1), Error);
}
