#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/rng.h"
#include "moe/gating_controller.h"

using namespace moetrain;

namespace {

template <class F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    FAIL() << "no error for " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

// A one-armed continuous bandit: reward −(a − 2)², feature 1. The policy mean θ₀ must climb
// from 0 toward the best action 2 with a running-mean baseline.
TEST(GatingController, PolicyGradientMovesTowardTheBetterAction) {
  GatingTheta theta{0.0, 0.0, 0.0};
  const double sigma = 0.5, lr = 0.02;
  const std::vector<double> phi{1.0, 0.0, 0.0};
  const Rng rng(7, rng_stream(RngPurpose::Test, 0, 0));
  double baseline = 0;
  for (int i = 0; i < 3000; ++i) {
    const std::vector<double> mu{theta[0]};
    const std::vector<double> a{mu[0] + sigma * rng.normal(static_cast<uint64_t>(i))};
    const double r = -(a[0] - 2.0) * (a[0] - 2.0);
    reinforce_step(theta, phi, a, mu, sigma, r - baseline, lr);
    baseline += 0.1 * (r - baseline);
  }
  EXPECT_NEAR(theta[0], 2.0, 0.3);
  EXPECT_EQ(theta[1], 0.0);  // features that are 0 get no gradient
}

TEST(GatingController, StartsByLoweringTheHotExpertsBias) {
  GatingControlConfig cfg;
  cfg.sigma = 1e-6;  // the mean action
  GatingController c(cfg, 4, 1, 0);
  const int64_t load[4] = {70, 10, 10, 10};
  const std::vector<double> a = c.update({load, 0.1, 1000}, 0);
  ASSERT_EQ(a.size(), 4u);
  EXPECT_LT(a[0], -1.0);  // d = 4·0.7 − 1 = 1.8, θ₀ = −1
  for (int e = 1; e < 4; ++e) EXPECT_GT(a[e], 0.0);
}

TEST(GatingController, StateRoundTripResumesExactly) {
  GatingControlConfig cfg;
  GatingController a(cfg, 4, 3, 1), b(cfg, 4, 3, 1);
  const int64_t loads[3][4] = {{40, 30, 20, 10}, {30, 30, 25, 15}, {26, 25, 25, 24}};
  const double times[3] = {0.2, 0.18, 0.17};
  for (int s = 0; s < 2; ++s) {
    a.update({loads[s], times[s], 1000}, static_cast<uint64_t>(s));
    b.update({loads[s], times[s], 1000}, static_cast<uint64_t>(s));
  }
  GatingController c(cfg, 4, 3, 1);
  c.restore(nlohmann::json::parse(a.to_json().dump()), "trainer_state.json");
  const std::vector<double> from_b = b.update({loads[2], times[2], 1000}, 2);
  const std::vector<double> from_c = c.update({loads[2], times[2], 1000}, 2);
  EXPECT_EQ(from_b, from_c);
  EXPECT_EQ(b.theta(), c.theta());
  EXPECT_EQ(b.to_json(), c.to_json());
  EXPECT_NE(b.theta(), (GatingTheta{-1.0, 0.0, 0.0}));  // it learned something to carry over
}

TEST(GatingController, BadKeysAndStatesNameWhatIsWrong) {
  expect_error([] { parse_router_controller("ppo"); }, "model.router_controller = 'ppo'");
  EXPECT_EQ(parse_router_controller("rl"), RouterControllerKind::Rl);
  EXPECT_EQ(parse_router_controller("none"), RouterControllerKind::None);
  GatingControlConfig c;
  c.sigma = 0;
  expect_error([&] { c.validate(); }, "gating.sigma");
  c = {}, c.lr = -1;
  expect_error([&] { c.validate(); }, "gating.lr");
  c = {}, c.baseline_lr = 2;
  expect_error([&] { c.validate(); }, "gating.baseline_lr");
  c = {}, c.time_decay = 1;
  expect_error([&] { c.validate(); }, "gating.time_decay");

  GatingController g({}, 4, 0, 0);
  const int64_t load[4] = {1, 2, 3, 4};
  g.update({load, 0.1, 100}, 0);
  nlohmann::json j = g.to_json();
  j["action"] = {1.0, 2.0};  // not one per expert
  expect_error([&] { g.restore(j, "x/trainer_state.json"); }, "'action' must be an array of 4");
  j = g.to_json();
  j.erase("theta");
  expect_error([&] { g.restore(j, "x/trainer_state.json"); }, "x/trainer_state.json");
}
