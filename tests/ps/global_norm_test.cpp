// The scheduler's rounds of servers' parts of an update's figures (ps/global_norm.h), without
// sockets: the sum is taken elementwise in server order, whatever the order the reports came
// in, and the clip decision is the single-process formula.
#include <gtest/gtest.h>

#include <cmath>

#include "core/check.h"
#include "optim/clip.h"
#include "ps/global_norm.h"
#include "support/expect_error.h"

using namespace moetrain;
using namespace moetrain::ps;
using moetrain::testing::expect_error;

TEST(GlobalNorm, SumsOnceEveryServerReportedInServerOrder) {
  NormRounds r(3);
  const auto t0 = NormRounds::Clock::now();
  const RoundKind clip = RoundKind::Clip, rw = RoundKind::Reweight;
  // Reports in reverse server order; the sum is still taken in server order.
  EXPECT_FALSE(r.report(0, 5, clip, 2, {0.75}, t0));
  EXPECT_FALSE(r.report(0, 5, clip, 1, {0.5}, t0));
  EXPECT_FALSE(r.report(0, 5, clip, 1, {2.0}, t0));  // a later report replaces the earlier one
  // Another kind of round of the same update is a round of its own.
  EXPECT_FALSE(r.report(0, 5, rw, 0, {1.0, 2.0}, t0));
  const auto d = r.report(0, 5, clip, 0, {1.25}, t0);
  ASSERT_TRUE(d);
  EXPECT_EQ(*d, std::vector<double>{(1.25 + 2.0) + 0.75});
  // A promoted backup asking again gets the same sum, whatever it reports.
  EXPECT_EQ(*r.report(0, 5, clip, 1, {9.0}, t0), *d);
  EXPECT_FALSE(r.report(0, 5, rw, 1, {3.0, 4.0}, t0));
  EXPECT_EQ(*r.report(0, 5, rw, 2, {5.0, 6.0}, t0), (std::vector<double>{9.0, 12.0}));
  expect_error([&] { r.report(0, 6, rw, 0, {1.0}, t0), r.report(0, 6, rw, 1, {1.0, 2.0}, t0); },
               "server 1: 2 reweight figures for update 6, another server sent 1");
}

TEST(GlobalNorm, TheClipDecisionIsTheTrainersFormula) {
  const ClipDecision d = decide_clip(4.0, 1.0);
  EXPECT_EQ(d.norm, 2.0);
  EXPECT_EQ(d.scale, clip_coefficient(2.0, 1.0));
  EXPECT_LT(d.scale, 1.0);
  EXPECT_EQ(decide_clip(4.0, 10.0).scale, 1.0);  // under the threshold nothing is scaled
  EXPECT_EQ(decide_clip(4.0, 0.0).scale, 1.0);   // no clipping
}

TEST(GlobalNorm, AnOverdueRoundNamesTheServersThatDidNotReport) {
  NormRounds r(3);
  const auto t0 = NormRounds::Clock::now();
  EXPECT_FALSE(r.report(0, 7, RoundKind::Clip, 1, {1.0}, t0));
  EXPECT_FALSE(r.overdue(10, t0 + std::chrono::seconds(5)));
  const auto late = r.overdue(10, t0 + std::chrono::seconds(11));
  ASSERT_TRUE(late);
  EXPECT_EQ(late->first, 7);
  EXPECT_EQ(late->second, (std::vector<int64_t>{0, 2}));
  // A roll-back undoes the clock: its round no longer waits.
  r.drop_before(1);
  EXPECT_FALSE(r.overdue(10, t0 + std::chrono::seconds(11)));
  // The replayed clock is a round of the new generation.
  EXPECT_FALSE(r.report(1, 7, RoundKind::Clip, 0, {1.0}, t0));
  EXPECT_FALSE(r.report(1, 7, RoundKind::Clip, 1, {1.0}, t0));
  EXPECT_TRUE(r.report(1, 7, RoundKind::Clip, 2, {1.0}, t0));
  EXPECT_FALSE(r.overdue(0, t0 + std::chrono::seconds(100)));
}

TEST(GlobalNorm, BadReportsAreRefused) {
  NormRounds r(2);
  expect_error([&] { r.report(0, 0, RoundKind::Clip, 2, {1.0}); },
               "a clip report from server 2");
  expect_error([&] { r.report(0, 0, RoundKind::Clip, 0, {std::nan("")}); },
               "server 0: a clip figure of nan");
  expect_error([&] { r.report(0, 0, RoundKind::Reweight, 0, {-1.0}); },
               "server 0: a reweight figure of -1");
  expect_error([&] { parse_round_kind("norm"); }, "a server round of kind 'norm'");
  for (RoundKind k : {RoundKind::Experts, RoundKind::Reweight, RoundKind::Clip})
    EXPECT_EQ(parse_round_kind(round_kind_name(k)), k);
}

// The experts round: the server holding the count keys sends the counts, the others zeros; the
// sum is the counts, exactly (integers in double), and a round of its own beside the clip's.
TEST(GlobalNorm, ExpertCountsReachEveryServer) {
  NormRounds r(2);
  const std::vector<double> counts = {0, 3, 16777216, 1};
  EXPECT_FALSE(r.report(0, 4, RoundKind::Experts, 0, std::vector<double>(counts.size(), 0.0)));
  EXPECT_FALSE(r.report(0, 4, RoundKind::Clip, 1, {2.0}));
  const auto sum = r.report(0, 4, RoundKind::Experts, 1, counts);
  ASSERT_TRUE(sum);
  EXPECT_EQ(*sum, counts);
}
