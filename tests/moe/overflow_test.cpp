// model.overflow = reroute (the load-aware assignment of moe/dispatch.h) and model.balance_loss =
// variance (moe/balance.h) in the layer: the rule on hand-built routings, what rerouting saves
// against dropping, and exact gradients by finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/check.h"
#include "layer_check.h"
#include "moe/dispatch.h"
#include "moe/moe_layer.h"
#include "moe/settings.h"
#include "support/expect_error.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

Routing routing_of(int64_t N, int64_t E, int64_t S, std::vector<int32_t> selected,
                   std::vector<float> weight) {
  Routing r;
  r.N = N, r.E = E, r.S = S;
  r.selected = std::move(selected);
  r.expert = r.selected;
  r.weight = std::move(weight);
  return r;
}

}  // namespace

// Four tokens all want expert 0, which takes one: the others go, surest first, to the next expert
// of their own order that has room.
TEST(RerouteOverflow, SurestTokenFirstEachToItsNextBestExpertWithRoom) {
  const int64_t N = 4, E = 3, S = 1;
  Routing r = routing_of(N, E, S, {0, 0, 0, 0}, {0.6f, 0.9f, 0.7f, 0.8f});
  // Keys: token 0 prefers 0 > 2 > 1, the others 0 > 1 > 2.
  const std::vector<float> key = {3, 1, 2, 3, 2, 1, 3, 2, 1, 3, 2, 1};
  const std::vector<float> score = {0.5f, 0.2f, 0.3f, 0.5f, 0.3f, 0.2f,
                                    0.6f, 0.3f, 0.1f, 0.7f, 0.2f, 0.1f};
  EXPECT_EQ(apply_capacity(r, 1), 3);  // token 1 (0.9) keeps expert 0
  EXPECT_EQ(r.expert, (std::vector<int32_t>{-1, 0, -1, -1}));
  EXPECT_EQ(reroute_overflow(r, 1, key.data(), score.data(), false), 2);
  // Token 3 (0.8) first takes expert 1, token 2 (0.7) finds it full and takes 2, token 0 (0.6)
  // finds both full and stays dropped.
  EXPECT_EQ(r.expert, (std::vector<int32_t>{-1, 0, 2, 1}));
  EXPECT_EQ(r.selected, (std::vector<int32_t>{0, 0, 0, 0}));  // what the router asked for
  // Unnormalised: a rerouted slot weighs the score of its new expert; the others keep theirs.
  EXPECT_EQ(r.weight, (std::vector<float>{0.6f, 0.9f, 0.1f, 0.2f}));
}

// Two slots a token, capacity 2: the new expert is none the token's weights already stand for,
// a masked (−inf) expert is never taken, ties in the key go to the lower expert, and the weights
// are renormalised over the experts they now stand for.
TEST(RerouteOverflow, TwoSlotsSkipTheTokensOwnExpertsAndRenormalise) {
  const int64_t N = 4, E = 4, S = 2;
  const float inf = std::numeric_limits<float>::infinity();
  Routing r = routing_of(N, E, S, {0, 1, 0, 1, 0, 2, 0, 1},
                         {0.6f, 0.4f, 0.7f, 0.3f, 0.65f, 0.35f, 0.8f, 0.2f});
  const std::vector<float> key = {4, 3, 2, 2, 4, 3, 1, 1, 4, 3, 5, 1, 4, 3, 1, -inf};
  const std::vector<float> score = {0.4f, 0.3f, 0.15f, 0.15f, 0.5f, 0.3f, 0.1f, 0.1f,
                                    0.5f, 0.1f, 0.25f, 0.15f, 0.6f, 0.3f, 0.1f, 0.0f};
  // Expert 0 keeps tokens 3 and 1, expert 1 tokens 0 and 1.
  EXPECT_EQ(apply_capacity(r, 2), 3);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{-1, 1, 0, 1, -1, 2, 0, -1}));
  EXPECT_EQ(reroute_overflow(r, 2, key.data(), score.data(), true), 2);
  // By weight: token 2's slot 0 (0.65) passes expert 2, which has room but is its own, and takes
  // 3; token 0's slot 0 (0.6) finds 2 and 3 tied with room and takes 2; token 3's slot 1 (0.2)
  // finds 0, 1, 2 full and 3 masked, and stays dropped.
  EXPECT_EQ(r.expert, (std::vector<int32_t>{2, 1, 0, 1, 3, 2, 0, -1}));
  EXPECT_EQ(r.selected, (std::vector<int32_t>{0, 1, 0, 1, 0, 2, 0, 1}));
  const float s0 = 0.15f + 0.3f, s2 = 0.15f + 0.25f;
  EXPECT_FLOAT_EQ(r.weight[0], 0.15f / s0);
  EXPECT_FLOAT_EQ(r.weight[1], 0.3f / s0);
  EXPECT_FLOAT_EQ(r.weight[4], 0.15f / s2);
  EXPECT_FLOAT_EQ(r.weight[5], 0.25f / s2);
  // Tokens that got no new expert keep the router's weights.
  EXPECT_EQ(r.weight[2], 0.7f);
  EXPECT_EQ(r.weight[3], 0.3f);
  EXPECT_EQ(r.weight[6], 0.8f);
  EXPECT_EQ(r.weight[7], 0.2f);
}

namespace {

struct Case {
  RouterKind router = RouterKind::TopKSoftmax;
  // With room for every assignment (E·capacity ≥ N·K), some experts overflow while others have
  // room: below 1 every expert may be full and nothing can be rerouted.
  float cf = 1.0f;
  bool renormalize = true;
  bool training = true;
  BalanceLoss loss = BalanceLoss::Switch;
  Overflow overflow = Overflow::Reroute;
  int64_t N = 12, E = 4, K = 2, G = 0, M = 0;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string s(router_kind_name(c.router));
  s += c.cf > 0 ? "_cf" + std::to_string(int(c.cf * 100))
                : (c.cf < 0 ? "_capped" + std::to_string(int(-c.cf * 100)) : "_dropless");
  s += std::string("_") + overflow_name(c.overflow) + "_" + balance_loss_name(c.loss);
  if (!c.renormalize) s += "_raw";
  if (!c.training) s += "_eval";
  if (c.G > 1) s += "_G" + std::to_string(c.G) + "M" + std::to_string(c.M);
  return s;
}

MoeConfig make_config(const Case& c) {
  MoeConfig cfg;
  cfg.C = 6, cfg.F = 5, cfg.E = c.E, cfg.K = c.K;
  cfg.route_groups = c.G, cfg.route_group_topk = c.M;
  cfg.router = c.router;
  cfg.capacity_factor = c.cf;
  cfg.renormalize = c.renormalize;
  cfg.overflow = c.overflow;
  cfg.balance_loss = c.loss;
  // Large enough that a wrong balancing-loss gradient shows above the tolerance.
  cfg.aux_loss_coef = 0.5f;
  cfg.z_loss_coef = 0.3f;
  return cfg;
}

}  // namespace

class OverflowLayerCase : public ::testing::TestWithParam<Case> {};

// The loss sum(out ⊙ R) + coefs · losses through rerouted slots (and the variance loss): the
// analytic gradients of every parameter and the input against central differences.
TEST_P(OverflowLayerCase, GradientsMatchFiniteDifferences) {
  const Case c = GetParam();
  LayerData s(make_config(c), c.N, 300);
  MoeLayer layer(s.cfg);
  if (c.router == RouterKind::SigmoidBias) {
    float* b = layer.router_bias();
    for (int64_t e = 0; e < s.cfg.E; ++e) b[e] = 0.15f * float(e % 3) - 0.1f;
  }
  MoeStep step{c.training, 1234, 5, 2};
  s.loss(layer, step);
  if (c.overflow == Overflow::Reroute) {
    ASSERT_GT(layer.stats().rerouted, 0) << "nothing rerouted: the case checks nothing of it";
  }
  const std::vector<int32_t> expert0 = layer.routing().expert, selected0 = layer.routing().selected;
  std::vector<float> dinp(s.N * s.cfg.C);
  layer.backward(dinp.data(), s.R.data(), s.w, s.g, 1.0f);
  auto loss = [&] { return s.loss(layer, step); };
  auto same = [&] {
    return layer.routing().expert == expert0 && layer.routing().selected == selected0;
  };
  MoeParamSizes sz = moe_param_sizes(s.cfg);
  check_gradient_routed(s.inp.data(), dinp.data(), s.N * s.cfg.C, loss, same, "dinp");
  check_gradient_routed(s.w.gate, s.g.gate, sz.gate, loss, same, "dgate");
  if (c.router == RouterKind::NoisyTopK && c.training)
    check_gradient_routed(s.w.noise, s.g.noise, sz.noise, loss, same, "dnoise");
  check_gradient_routed(s.w.w1, s.g.w1, sz.w1, loss, same, "dw1");
  check_gradient_routed(s.w.w2, s.g.w2, sz.w2, loss, same, "dw2");
}

std::vector<Case> overflow_cases() {
  std::vector<Case> cases;
  for (RouterKind r : {RouterKind::TopKSoftmax, RouterKind::NoisyTopK, RouterKind::SigmoidBias}) {
    cases.push_back({r});
    cases.push_back({r, -1.0f});  // the agreed capacity
  }
  cases.push_back({RouterKind::TopKSoftmax, 1.0f, false});
  cases.push_back({RouterKind::SigmoidBias, 1.0f, false});
  cases.push_back({RouterKind::NoisyTopK, 1.0f, true, false});
  // Group-limited: 4 groups of 2, each token keeps 2; rerouting stays within them.
  cases.push_back({RouterKind::TopKSoftmax, 1.0f, true, true, BalanceLoss::Switch,
                   Overflow::Reroute, 16, 8, 2, 4, 2});
  cases.push_back({RouterKind::SigmoidBias, 1.0f, true, true, BalanceLoss::Switch,
                   Overflow::Reroute, 16, 8, 3, 4, 2});
  // The variance loss, dropless, dropping and rerouting.
  for (RouterKind r : {RouterKind::TopKSoftmax, RouterKind::NoisyTopK}) {
    cases.push_back({r, 0.0f, true, true, BalanceLoss::Variance, Overflow::Drop});
    cases.push_back({r, 0.5f, true, true, BalanceLoss::Variance, Overflow::Drop});
    cases.push_back({r, 1.0f, true, true, BalanceLoss::Variance, Overflow::Reroute});
  }
  cases.push_back(
      {RouterKind::TopKSoftmax, 0.0f, false, true, BalanceLoss::Variance, Overflow::Drop, 7, 8, 3});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Routers, OverflowLayerCase, ::testing::ValuesIn(overflow_cases()),
                         case_name);

// Against dropping at the same capacity: fewer assignments lost whenever some expert had room,
// none of the router's kept ones moved, no expert over capacity, and every computed row
// accounted for.
TEST(OverflowLayer, RerouteDropsFewerAndNoExpertExceedsCapacity) {
  int64_t with_room = 0;
  for (RouterKind router :
       {RouterKind::TopKSoftmax, RouterKind::NoisyTopK, RouterKind::SigmoidBias}) {
    for (float cf : {0.6f, 0.9f, 1.0f, -1.0f}) {
      Case c;
      c.router = router, c.cf = cf, c.N = 96, c.E = 8;
      c.overflow = Overflow::Drop;
      LayerData drop_data(make_config(c), c.N, 400);
      c.overflow = Overflow::Reroute;
      LayerData reroute_data(make_config(c), c.N, 400);
      MoeLayer drop(drop_data.cfg), reroute(reroute_data.cfg);
      const MoeStep step{true, 7, 1, 0};
      drop_data.loss(drop, step);
      reroute_data.loss(reroute, step);
      const std::string where = std::string(router_kind_name(router)) + " cf " + std::to_string(cf);
      const MoeStats &a = drop.stats(), &b = reroute.stats();
      ASSERT_GT(a.dropped, 0) << where << ": the capacity drops nothing, the test checks nothing";
      EXPECT_EQ(a.capacity, b.capacity) << where;
      EXPECT_EQ(a.assignments, b.assignments) << where;
      bool room = false;  // an expert under capacity after dropping: rerouting must use it
      for (int64_t n : a.tokens_per_expert) room |= n < a.capacity;
      with_room += room;
      if (room) {
        EXPECT_LT(b.dropped, a.dropped) << where;
      } else {
        EXPECT_EQ(b.dropped, a.dropped) << where;
      }
      EXPECT_EQ(b.dropped + b.rerouted, a.dropped) << where;
      int64_t rows = 0;
      for (int64_t e = 0; e < c.E; ++e) {
        EXPECT_LE(b.tokens_per_expert[e], b.capacity) << where << " expert " << e;
        rows += b.tokens_per_expert[e];
      }
      EXPECT_EQ(rows, b.assignments - b.dropped) << where;
      const Routing &ra = drop.routing(), &rb = reroute.routing();
      EXPECT_EQ(ra.selected, rb.selected) << where;
      for (int64_t i = 0; i < c.N * c.K; ++i) {
        if (ra.expert[i] >= 0) {
          EXPECT_EQ(rb.expert[i], ra.expert[i]) << where << " slot " << i;
        }
      }
      // A token never holds one expert twice.
      for (int64_t t = 0; t < c.N; ++t)
        for (int64_t k = 0; k < c.K; ++k)
          for (int64_t j = 0; j < k; ++j)
            if (rb.expert[t * c.K + k] >= 0) {
              EXPECT_NE(rb.expert[t * c.K + k], rb.expert[t * c.K + j]) << where;
            }
      // The aux loss counts what the router asked for, which rerouting leaves unchanged.
      EXPECT_EQ(drop.aux_loss(), reroute.aux_loss()) << where;
    }
  }
  EXPECT_GE(with_room, 6) << "too few cases where rerouting could help: the test checks little";
}

TEST(OverflowLayer, SettingsRefusedWhereTheyHaveNoMeaning) {
  MoeConfig cfg = make_config({});
  cfg.capacity_factor = 0.0f;
  expect_error([&] { cfg.validate(); }, {"model.overflow = reroute needs a capacity",
                                         "model.capacity_factor = 0 is dropless"});
  cfg.router = RouterKind::ExpertChoice, cfg.capacity_factor = 1.0f;
  expect_error([&] { MoeLayer layer(cfg); }, {"model.overflow = reroute", "expert_choice"});
  cfg = make_config({});
  cfg.overflow = Overflow::Drop, cfg.balance_loss = BalanceLoss::Variance;
  for (RouterKind r : {RouterKind::SigmoidBias, RouterKind::ExpertChoice}) {
    cfg.router = r;
    expect_error([&] { cfg.validate(); },
                 {"model.balance_loss = variance", std::string(router_kind_name(r))});
  }
  expect_error([] { parse_overflow("spill"); }, {"model.overflow = 'spill'", "drop, reroute"});
  expect_error([] { parse_balance_loss("l2"); }, {"model.balance_loss = 'l2'", "switch, variance"});
  MoeModelConfig m;
  m.overflow = Overflow::Reroute;
  expect_error([&] { m.validate_moe(); }, {"model.overflow = reroute needs a capacity"});
  m.capacity_factor = 1.25;
  m.validate_moe();
  m.router = RouterKind::ExpertChoice;
  expect_error([&] { m.validate_moe(); }, {"model.overflow = reroute"});
}
