#include "optim/expert_reweight.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "optim/update.h"

using namespace moetrain;

namespace {

void expect_factors(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t e = 0; e < want.size(); ++e) EXPECT_NEAR(got[e], want[e], 1e-12) << "e=" << e;
}

// Two MoE layers of two experts, two tensors each, with a dense tensor between them:
//   [0, 4) dense, layer 0: e0 w1 [4, 6), e1 w1 [6, 8), e0 w2 [8, 10), e1 w2 [10, 12),
//   [12, 14) dense, layer 1: e0 [14, 16) [18, 20), e1 [16, 18) [20, 22).
class TwoLayerTable : public ParamTable {
 public:
  TwoLayerTable() {
    add("model.embed_tokens.weight", {4}, true);
    add_layer("model.layers.0.block_sparse_moe");
    add("model.layers.1.input_layernorm.weight", {2}, false);
    add_layer("model.layers.1.block_sparse_moe");
  }

 private:
  void add_layer(const std::string& p) {
    for (const char* w : {"w1", "w2"})
      for (int e = 0; e < 2; ++e)
        add(fmt::format("{}.experts.{}.{}.weight", p, e, w), {2}, true, e);
  }
};

std::vector<float> table_grads(const TwoLayerTable& t, const std::vector<float>& values) {
  std::vector<float> g(static_cast<std::size_t>(t.size()), 0.0f);
  std::size_t i = 0;
  for (const ParamInfo& p : t.params())
    for (int64_t k = 0; k < p.numel; ++k) g[p.offset + k] = values[i++];
  return g;
}

}  // namespace

TEST(ExpertReweight, ParsesModesAndNamesTheKey) {
  EXPECT_EQ(parse_expert_reweight("none"), ExpertReweightMode::None);
  EXPECT_EQ(parse_expert_reweight("grad_norm"), ExpertReweightMode::GradNorm);
  try {
    parse_expert_reweight("utilization");
    FAIL() << "accepted an unknown mode";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("grad.expert_reweight = 'utilization'"), std::string::npos)
        << e.what();
  }
}

TEST(ExpertReweight, NormalisesToMeanOneOverPositiveEntries) {
  expect_factors(normalise_mean_one({1, 3, 0}), {0.5, 1.5, 1});
  expect_factors(normalise_mean_one({2, 2, 2, 2}), {1, 1, 1, 1});
  expect_factors(normalise_mean_one({0, 0}), {1, 1});
}

TEST(ExpertReweight, UtilisationFactorsByHand) {
  // Mean load 150: 10 < 0.5·150 → ×2, 400 > 2·150 → ×0.5; raw {2, 1, 0.5, 1} has mean 1.125.
  expect_factors(utilisation_factors({10, 100, 400, 90}, 0.5, 2.0),
                 {16.0 / 9, 8.0 / 9, 4.0 / 9, 8.0 / 9});
  // Balanced: all ones. The thresholds are configurable: with 0.95 and 1.05 of the mean 110,
  // 100 is rare (×2) and 120 saturated (×0.5): raw {2, 0.5, 1} has mean 3.5 / 3.
  expect_factors(utilisation_factors({5, 5, 5}, 0.5, 2.0), {1, 1, 1});
  expect_factors(utilisation_factors({100, 120, 110}, 0.95, 1.05), {6 / 3.5, 1.5 / 3.5, 3 / 3.5});
}

TEST(ExpertReweight, GradNormFactorsByHand) {
  // raw 1/‖g‖ = {1, 0.5, 0.25}; the expert without a gradient keeps 1 and is not averaged.
  expect_factors(grad_norm_factors({1, 2, 4, 0}), {12.0 / 7, 6.0 / 7, 3.0 / 7, 1});
}

TEST(ExpertReweight, ImportanceMovingAverageByHand) {
  std::vector<double> avg = {0, 0};
  expect_factors(importance_factors(avg, {3, 1}, 0.5, /*first=*/true), {1.5, 0.5});
  expect_factors(avg, {3, 1});
  // avg = 0.5·{3, 1} + 0.5·{1, 1} = {2, 1}.
  expect_factors(importance_factors(avg, {1, 1}, 0.5, false), {4.0 / 3, 2.0 / 3});
  expect_factors(avg, {2, 1});
}

TEST(ExpertReweight, AppliesEachExpertsFactorToItsRangesOnly) {
  const TwoLayerTable table;
  ExpertReweighter rw({ExpertReweightMode::GradNorm}, table);
  EXPECT_EQ(rw.layers(), 2);
  EXPECT_EQ(rw.experts(), 2);
  // Layer 0: e0 {3, 0, 4, 0} (‖‖ = 5), e1 {6, 0, 8, 0} (10): factors {4/3, 2/3}.
  // Layer 1: e0 and e1 both of norm 1: factors {1, 1}.
  std::vector<float> g =
      table_grads(table, {1, 1, 1, 1, 3, 0, 6, 0, 4, 0, 8, 0, 7, 7, 1, 0, 0, 1, 0, 0, 0, 0});
  const std::vector<float> before = g;
  FlatGradient flat(g.data(), static_cast<int64_t>(g.size()));
  auto comm = make_local_comm();
  rw.apply(flat, *comm);
  expect_factors(rw.factors()[0], {4.0 / 3, 2.0 / 3});
  expect_factors(rw.factors()[1], {1, 1});
  EXPECT_NEAR(rw.layer_min()[0], 2.0 / 3, 1e-12);
  EXPECT_NEAR(rw.layer_max()[0], 4.0 / 3, 1e-12);
  for (const ParamInfo& p : table.params()) {
    double f = 1;
    if (p.expert >= 0 && p.name.rfind("model.layers.0.", 0) == 0) f = rw.factors()[0][p.expert];
    for (int64_t k = 0; k < p.numel; ++k)
      EXPECT_FLOAT_EQ(g[p.offset + k], static_cast<float>(before[p.offset + k] * f)) << p.name;
  }
}

TEST(ExpertReweight, ImportanceStateRoundTrips) {
  const TwoLayerTable table;
  ExpertReweighter a({ExpertReweightMode::Importance, 0.9}, table);
  std::vector<float> g =
      table_grads(table, {1, 1, 1, 1, 3, 0, 6, 0, 4, 0, 8, 0, 7, 7, 1, 0, 0, 1, 0, 0, 0, 0});
  auto comm = make_local_comm();
  std::vector<float> g1 = g;
  FlatGradient f1(g1.data(), static_cast<int64_t>(g1.size()));
  a.apply(f1, *comm);
  // mean |g| per expert over its 4 elements: layer 0 {7/4, 14/4} → {2/3, 4/3}.
  expect_factors(a.factors()[0], {2.0 / 3, 4.0 / 3});
  ExpertReweighter b({ExpertReweightMode::Importance, 0.9}, table);
  b.restore(nlohmann::json::parse(a.to_json().dump()), "test");
  // A second step with another gradient: the average carries the first step's values.
  for (float& v : g) v = v * v + 1;
  std::vector<float> ga = g, gb = g;
  FlatGradient fa(ga.data(), static_cast<int64_t>(ga.size()));
  FlatGradient fb(gb.data(), static_cast<int64_t>(gb.size()));
  a.apply(fa, *comm);
  b.apply(fb, *comm);
  EXPECT_EQ(ga, gb);
  // Without the restored state b would take the step's own values, not the average.
  ExpertReweighter fresh({ExpertReweightMode::Importance, 0.9}, table);
  std::vector<float> gc = g;
  FlatGradient fc(gc.data(), static_cast<int64_t>(gc.size()));
  fresh.apply(fc, *comm);
  EXPECT_NE(ga, gc);
  EXPECT_THROW(b.restore({{"steps", 1}, {"importance_avg", {{1.0}}}}, "test"), Error);
}

TEST(ExpertReweight, AppliedBeforeTheClip) {
  // With clipping active, the clipped gradient has norm grad_clip after reweighting: the norm
  // check_and_clip reports and clips by is the reweighted gradient's.
  const TwoLayerTable table;
  ExpertReweighter rw({ExpertReweightMode::GradNorm}, table);
  std::vector<float> g =
      table_grads(table, {0, 0, 0, 0, 3, 0, 6, 0, 4, 0, 8, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0});
  // Reweighted: layer 0 experts both of norm 20/3, layer 1 of norm 1 → ‖g‖² = 2·400/9 + 2.
  const double reweighted = std::sqrt(800.0 / 9 + 2);
  FlatGradient flat(g.data(), static_cast<int64_t>(g.size()));
  auto comm = make_local_comm();
  UpdateOptions opts;
  opts.grad_clip = 1.0;
  opts.reweight = &rw;
  const UpdateOutcome out = check_and_clip(flat, *comm, opts);
  EXPECT_NEAR(out.grad_norm, reweighted, 1e-5);
  double sq = 0;
  for (float v : g) sq += static_cast<double>(v) * v;
  EXPECT_NEAR(std::sqrt(sq), 1.0, 1e-5);
  // The experts of layer 0 now have equal norms (4/3·5 = 2/3·10).
  EXPECT_NEAR(std::hypot(g[4], g[8]), std::hypot(g[6], g[10]), 1e-6);
}
