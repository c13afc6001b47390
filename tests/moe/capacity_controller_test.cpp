#include <gtest/gtest.h>

#include <deque>
#include <string>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "moe/capacity_controller.h"

using namespace moetrain;

namespace {

CapacityControlConfig small_window() {
  CapacityControlConfig c;
  c.window = 4;
  return c;
}

void expect_error(const CapacityControlConfig& c, const std::string& needle) {
  try {
    c.validate();
    FAIL() << "no error for " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(CapacityController, SlopeIsTheLeastSquaresFit) {
  EXPECT_DOUBLE_EQ(least_squares_slope({}), 0.0);
  EXPECT_DOUBLE_EQ(least_squares_slope({3.0}), 0.0);
  EXPECT_DOUBLE_EQ(least_squares_slope({1.0, 3.0, 5.0}), 2.0);
  // x̄ = 1.5, ȳ = 0.5: Σ dx·dy = 0.5 and Σ dx² = 5.
  EXPECT_NEAR(least_squares_slope({0.0, 1.0, 0.0, 1.0}), 0.2, 1e-12);
  EXPECT_NEAR(least_squares_slope({0.9, 0.8, 0.7, 0.6}), -0.1, 1e-12);
}

TEST(CapacityController, LowUtilisationWithImbalanceShrinks) {
  CapacityController c(small_window(), 1.0);
  EXPECT_EQ(c.update(0.3, 3.0), CapacityRule::Shrink);
  EXPECT_DOUBLE_EQ(c.cf(), 0.9);
}

TEST(CapacityController, HighUtilisationBalancedGrows) {
  CapacityController c(small_window(), 1.0);
  EXPECT_EQ(c.update(0.95, 1.05), CapacityRule::Grow);
  EXPECT_DOUBLE_EQ(c.cf(), 1.1);
}

TEST(CapacityController, FallingTrendOverAFullWindowShrinksGently) {
  CapacityController c(small_window(), 1.0);
  // Middle utilisation, middle imbalance: neither threshold rule fires.
  EXPECT_EQ(c.update(0.80, 1.5), CapacityRule::Keep);
  EXPECT_EQ(c.update(0.75, 1.5), CapacityRule::Keep);
  EXPECT_EQ(c.update(0.70, 1.5), CapacityRule::Keep);  // window not yet full
  EXPECT_DOUBLE_EQ(c.cf(), 1.0);
  EXPECT_EQ(c.update(0.65, 1.5), CapacityRule::Trend);
  EXPECT_DOUBLE_EQ(c.cf(), 0.95);
  // A flat window keeps.
  CapacityController flat(small_window(), 1.0);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(flat.update(0.7, 1.5), CapacityRule::Keep);
  EXPECT_DOUBLE_EQ(flat.cf(), 1.0);
  EXPECT_EQ(flat.history().size(), 4u);
}

TEST(CapacityController, ClampsToTheBounds) {
  CapacityController lo(small_window(), 0.52);
  lo.update(0.1, 5.0);
  EXPECT_DOUBLE_EQ(lo.cf(), 0.5);
  CapacityController hi(small_window(), 1.95);
  hi.update(1.0, 1.0);
  EXPECT_DOUBLE_EQ(hi.cf(), 2.0);
  CapacityController start(small_window(), 7.0);
  EXPECT_DOUBLE_EQ(start.cf(), 2.0);
}

TEST(CapacityController, StateRoundTripsExactly) {
  CapacityController a(small_window(), 1.0), b(small_window(), 1.0);
  const double u[] = {0.81, 0.77, 0.3, 0.71, 0.95, 0.64};
  const double i[] = {1.5, 1.4, 2.5, 1.5, 1.1, 1.6};
  for (int s = 0; s < 3; ++s) a.update(u[s], i[s]);
  b.restore(nlohmann::json::parse(a.to_json().dump()), "state.json");
  for (int s = 3; s < 6; ++s) EXPECT_EQ(a.update(u[s], i[s]), b.update(u[s], i[s]));
  EXPECT_EQ(a.cf(), b.cf());
  EXPECT_EQ(a.history(), b.history());
}

TEST(CapacityController, BadSettingsNameTheKey) {
  CapacityControlConfig c;
  c.cf_min = 2.0, c.cf_max = 0.5;
  expect_error(c, "balance.cf_max");
  c = {};
  c.cf_min = 0;
  expect_error(c, "balance.cf_min");
  c = {};
  c.cf_min = -1, c.cf_max = -0.5;
  expect_error(c, "balance.cf_min");
  c = {};
  c.window = 1;
  expect_error(c, "balance.window");
  c = {};
  c.util_low = 0.9, c.util_high = 0.5;
  expect_error(c, "balance.util_high");
  c = {};
  c.imbalance_low = 3, c.imbalance_high = 2;
  expect_error(c, "balance.imbalance_high");
  CapacityController ok(CapacityControlConfig{}, 1.0);
  EXPECT_THROW(ok.restore(nlohmann::json{{"cf", 9.0}, {"history", nlohmann::json::array()}}, "x"),
               Error);
}
