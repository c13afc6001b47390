// The adaptive route's chooser (parallel/adaptive_route.h) on made-up exchange times: it keeps
// the cheaper path, measures the other one on probe steps, moves within probe_every steps when
// the path it uses slows down, and does not flap when the two paths cost about the same.
#include <gtest/gtest.h>

#include <functional>

#include "core/check.h"
#include "parallel/adaptive_route.h"

using namespace moetrain;

namespace {

RouteChoiceOptions options(int64_t probe_every, bool start_relayed = false, double margin = 0.1,
                           double smoothing = 0.5) {
  RouteChoiceOptions o;
  o.probe_every = probe_every, o.start_relayed = start_relayed;
  o.margin = margin, o.smoothing = smoothing;
  return o;
}

// Runs steps [first, last] with seconds per exchange cost(step, relayed); returns the step
// after which the choice first differs from `from` (-1: never).
int64_t drive(RouteChooser& c, int64_t first, int64_t last,
              const std::function<double(int64_t, bool)>& cost, bool from) {
  int64_t switched = -1;
  for (int64_t s = first; s <= last; ++s) {
    c.observe(s, cost(s, c.relayed_at(s)));
    if (switched < 0 && c.relayed() != from) switched = s;
  }
  return switched;
}

}  // namespace

TEST(RouteChooser, ProbesTheOtherPathEveryNthStep) {
  RouteChooser c(options(4, false));
  for (int64_t s = 1; s <= 12; ++s) EXPECT_EQ(c.relayed_at(s), s % 4 == 0) << "step " << s;
  RouteChooser r(options(4, true));
  EXPECT_FALSE(r.relayed_at(4));
  EXPECT_TRUE(r.relayed_at(5));
  EXPECT_LT(c.estimate(false), 0);  // nothing measured yet
}

TEST(RouteChooser, SwitchesWithinAProbeIntervalAfterTheLinkChanges) {
  constexpr int64_t kProbe = 5, kChange = 23;
  for (const bool slow_relay_first : {true, false}) {
    // Before the change the relayed path is slow (5 ms against 1 ms); from kChange on the direct
    // one is (5 ms) and the relayed one fast (1 ms); or the other way round.
    auto cost = [&](int64_t s, bool relayed) {
      const bool slow = (s >= kChange) != slow_relay_first ? relayed : !relayed;
      return slow ? 5e-3 : 1e-3;
    };
    const bool start = !slow_relay_first;  // starts on the path that is fast first
    RouteChooser c(options(kProbe, start));
    EXPECT_EQ(drive(c, 1, kChange - 1, cost, start), -1) << "switched before the change";
    EXPECT_GE(c.estimate(!start), 4e-3);  // the probes measured the slow path
    const int64_t at = drive(c, kChange, kChange + 3 * kProbe, cost, start);
    EXPECT_GE(at, kChange);
    EXPECT_LE(at, kChange + kProbe) << "slow to react";
    EXPECT_EQ(c.relayed(), !start);
    EXPECT_EQ(c.switches(), 1);  // and it stayed
  }
}

TEST(RouteChooser, StaleFigureOfTheOtherPathSwitchesAtOnce) {
  // The other path was measured cheap-ish (2 ms); the used one goes from 1 ms to 10 ms.
  RouteChooser c(options(10));
  auto cost = [](int64_t s, bool relayed) { return relayed ? 2e-3 : (s < 12 ? 1e-3 : 10e-3); };
  EXPECT_EQ(drive(c, 1, 11, cost, false), -1);
  EXPECT_EQ(drive(c, 12, 30, cost, false), 12);
}

TEST(RouteChooser, DoesNotFlapOnNoise) {
  // Both paths about 1 ms, each figure off by up to ±4 %: inside the 10 % margin.
  RouteChooser c(options(3));
  auto cost = [](int64_t s, bool relayed) {
    const double noise = 0.04 * static_cast<double>((s * 7 + (relayed ? 3 : 0)) % 5 - 2) / 2;
    return 1e-3 * (1 + noise);
  };
  EXPECT_EQ(drive(c, 1, 200, cost, false), -1);
  EXPECT_EQ(c.switches(), 0);
}

TEST(RouteChooser, BadSettingsAreRefused) {
  EXPECT_THROW(RouteChooser{options(1)}, Error);
  EXPECT_THROW(RouteChooser(options(10, false, 1.0)), Error);
  EXPECT_THROW(RouteChooser(options(10, false, 0.1, 0.0)), Error);
  RouteChooser c(options(10));
  EXPECT_THROW(c.observe(1, -1.0), Error);
}
