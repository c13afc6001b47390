// The scheduler's rounds of partial gradient norms (ps/global_norm.h), without sockets: the
// decision is the single-process formula over the partials added in server order, whatever the
// order the reports came in.
#include <gtest/gtest.h>

#include <cmath>

#include "core/check.h"
#include "optim/clip.h"
#include "ps/global_norm.h"
#include "support/expect_error.h"

using namespace moetrain;
using namespace moetrain::ps;
using moetrain::testing::expect_error;

TEST(GlobalNorm, DecidesOnceEveryServerReportedWithTheTrainersFormula) {
  const double clip = 1.0;
  NormRounds r(3, clip);
  const auto t0 = NormRounds::Clock::now();
  // Reports in reverse server order; the sum is still taken in server order.
  EXPECT_FALSE(r.report(0, 5, 2, 0.75, t0));
  EXPECT_FALSE(r.report(0, 5, 1, 0.5, t0));
  EXPECT_FALSE(r.report(0, 5, 1, 2.0, t0));  // a server's later report replaces its earlier one
  const auto d = r.report(0, 5, 0, 1.25, t0);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->sum_squares, (1.25 + 2.0) + 0.75);
  EXPECT_EQ(d->norm, std::sqrt(4.0));
  EXPECT_EQ(d->scale, clip_coefficient(2.0, clip));
  EXPECT_LT(d->scale, 1.0);
  // A promoted backup asking again gets the same decision, whatever it reports.
  const auto again = r.report(0, 5, 1, 9.0, t0);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->scale, d->scale);
  // Under the threshold nothing is scaled.
  NormRounds loose(1, 10.0);
  EXPECT_EQ(loose.report(0, 0, 0, 4.0, t0)->scale, 1.0);
  EXPECT_EQ(decide_clip({1.0, 3.0}, 10.0).scale, 1.0);
}

TEST(GlobalNorm, AnOverdueRoundNamesTheServersThatDidNotReport) {
  NormRounds r(3, 1.0);
  const auto t0 = NormRounds::Clock::now();
  EXPECT_FALSE(r.report(0, 7, 1, 1.0, t0));
  EXPECT_FALSE(r.overdue(10, t0 + std::chrono::seconds(5)));
  const auto late = r.overdue(10, t0 + std::chrono::seconds(11));
  ASSERT_TRUE(late);
  EXPECT_EQ(late->first, 7);
  EXPECT_EQ(late->second, (std::vector<int64_t>{0, 2}));
  // A roll-back undoes the clock: its round no longer waits.
  r.drop_before(1);
  EXPECT_FALSE(r.overdue(10, t0 + std::chrono::seconds(11)));
  // The replayed clock is a round of the new generation.
  EXPECT_FALSE(r.report(1, 7, 0, 1.0, t0));
  EXPECT_FALSE(r.report(1, 7, 1, 1.0, t0));
  EXPECT_TRUE(r.report(1, 7, 2, 1.0, t0));
  EXPECT_FALSE(r.overdue(0, t0 + std::chrono::seconds(100)));
}

TEST(GlobalNorm, BadReportsAreRefused) {
  NormRounds r(2, 1.0);
  expect_error([&] { r.report(0, 0, 2, 1.0); }, "a partial norm from server 2");
  expect_error([&] { r.report(0, 0, 0, std::nan("")); }, "partial sum of squares nan");
  expect_error([&] { r.report(0, 0, 0, -1.0); }, "partial sum of squares -1");
}
