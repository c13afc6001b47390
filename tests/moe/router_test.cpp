#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "moe/config.h"
#include "moe/moe_layer.h"
#include "moe/router.h"
#include "support/expect_error.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

MoeConfig valid_config() {
  MoeConfig cfg;
  cfg.C = 8, cfg.F = 4, cfg.E = 4, cfg.K = 2;
  return cfg;
}

}  // namespace

TEST(RouterKind, ParsesEveryNameAndRejectsOthers) {
  for (const char* name : {"topk_softmax", "noisy_topk", "expert_choice", "sigmoid_bias"}) {
    EXPECT_EQ(router_kind_name(parse_router_kind(name)), name);
  }
  EXPECT_EQ(parse_router_kind("noisy_topk"), RouterKind::NoisyTopK);
  std::string msg = error_of([] { parse_router_kind("top2"); });
  EXPECT_NE(msg.find("'top2'"), std::string::npos) << msg;
  for (const char* name : {"topk_softmax", "noisy_topk", "expert_choice", "sigmoid_bias"}) {
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
  }
}

TEST(MoeConfig, EachInvalidFieldIsNamed) {
  EXPECT_NO_THROW(valid_config().validate());
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  struct Bad {
    std::function<void(MoeConfig&)> mutate;
    const char* field;
  };
  const Bad bad[] = {
      {[](MoeConfig& c) { c.C = 0; }, "C (model dim) is 0"},
      {[](MoeConfig& c) { c.F = -3; }, "F (expert hidden size) is -3"},
      {[](MoeConfig& c) { c.E = 0; }, "E (experts) is 0"},
      {[](MoeConfig& c) { c.K = 0; }, "K (top-k) is 0, must be in [1, E] = [1, 4]"},
      {[](MoeConfig& c) { c.K = 5; }, "K (top-k) is 5"},
      {[](MoeConfig& c) { c.router = static_cast<RouterKind>(9); }, "router is 9"},
      {[](MoeConfig& c) { c.router = RouterKind::ExpertChoice, c.capacity_factor = -0.5f; },
       "capacity_factor is -0.5, must be >= 0 with expert_choice"},
      {[nan](MoeConfig& c) { c.capacity_factor = nan; }, "capacity_factor is nan"},
      {[](MoeConfig& c) { c.aux_loss_coef = -1.0f; }, "aux_loss_coef is -1"},
      {[inf](MoeConfig& c) { c.z_loss_coef = inf; }, "z_loss_coef is inf"},
      {[](MoeConfig& c) { c.bias_update_rate = -1e-3f; }, "bias_update_rate is -0.001"},
      {[](MoeConfig& c) { c.shared_F = -1; }, "shared_F (shared expert hidden size) is -1"},
      {[](MoeConfig& c) { c.router_skew = -0.5f; }, "model.router_skew = -0.5: must be"},
      {[](MoeConfig& c) { c.route_groups = -1; }, "model.route_groups = -1: must be >= 0"},
      {[](MoeConfig& c) { c.route_groups = 3, c.route_group_topk = 1; },
       "model.route_groups = 3: must divide model.n_experts = 4"},
      {[](MoeConfig& c) { c.route_groups = 2, c.route_group_topk = 3; },
       "model.route_group_topk = 3: must be in [1, model.route_groups = 2]"},
      {[](MoeConfig& c) { c.route_groups = 2; }, "model.route_group_topk = 0: must be in [1"},
      {[](MoeConfig& c) { c.route_groups = 4, c.route_group_topk = 1; },
       "model.route_group_topk = 1: the kept groups hold 1 · 1 = 1 experts, fewer than "
       "model.top_k = 2"},
      {[](MoeConfig& c) {
         c.route_groups = 2, c.route_group_topk = 1, c.router = RouterKind::ExpertChoice;
       },
       "model.router = expert_choice"},
  };
  for (const Bad& b : bad) {
    MoeConfig cfg = valid_config();
    b.mutate(cfg);
    std::string msg = error_of([&] { cfg.validate(); });
    EXPECT_NE(msg.find(b.field), std::string::npos)
        << "expected '" << b.field << "' in '" << msg << "'";
    EXPECT_THROW(MoeLayer layer(cfg), Error);
  }
}

TEST(MoeConfig, ParameterSizesAndBufferLayout) {
  MoeConfig cfg = valid_config();
  MoeParamSizes s = moe_param_sizes(cfg);
  EXPECT_EQ(s.gate, 32);
  EXPECT_EQ(s.noise, 0);
  EXPECT_EQ(s.w1, 4 * 4 * 8);
  EXPECT_EQ(s.w3, 128);
  EXPECT_EQ(s.w2, 128);
  EXPECT_EQ(s.shared_w1 + s.shared_w3 + s.shared_w2, 0);
  EXPECT_EQ(s.total(), 32 + 3 * 128);
  cfg.router = RouterKind::NoisyTopK;
  cfg.shared_F = 6;
  s = moe_param_sizes(cfg);
  EXPECT_EQ(s.noise, 32);
  EXPECT_EQ(s.shared_w1, 48);
  EXPECT_EQ(s.shared_w2, 48);
  std::vector<float> buf(s.total());
  MoeWeights w = moe_weights_from_buffer(cfg, buf.data());
  float* p = buf.data();
  EXPECT_EQ(w.gate, p);
  EXPECT_EQ(w.noise, p + 32);
  EXPECT_EQ(w.w1, p + 64);
  EXPECT_EQ(w.w3, p + 192);
  EXPECT_EQ(w.w2, p + 320);
  EXPECT_EQ(w.shared_w1, p + 448);
  EXPECT_EQ(w.shared_w3, p + 496);
  EXPECT_EQ(w.shared_w2, p + 544);
  EXPECT_EQ(s.total(), 592);
  cfg.router = RouterKind::TopKSoftmax;
  cfg.shared_F = 0;
  w = moe_weights_from_buffer(cfg, buf.data());
  EXPECT_EQ(w.noise, nullptr);
  EXPECT_EQ(w.shared_w1, nullptr);
}

// The skew is a fixed offset −s·ln(e + 1) on every token's logits: with a zero gate the logits are
// exactly the offsets, and a skewed random router sends expert 0 more than the last expert.
TEST(RouterSkew, OffsetsEveryLogitByZipf) {
  MoeConfig cfg = valid_config();
  cfg.router_skew = 1.2f;
  const int64_t N = 64;
  std::vector<float> inp(N * cfg.C), gate(cfg.E * cfg.C, 0.0f);
  for (std::size_t i = 0; i < inp.size(); ++i) inp[i] = std::sin(0.37f * static_cast<float>(i));
  Routing r;
  RouterCache cache;
  router_forward(r, cache, inp.data(), N, cfg, gate.data(), nullptr, nullptr, MoeStep{});
  for (int64_t t = 0; t < N; ++t)
    for (int64_t e = 0; e < cfg.E; ++e)
      EXPECT_NEAR(cache.logits[t * cfg.E + e], -1.2 * std::log(double(e + 1)), 1e-5);
  for (std::size_t i = 0; i < gate.size(); ++i) gate[i] = 0.3f * std::cos(1.3f * float(i));
  int64_t first = 0, last = 0;
  router_forward(r, cache, inp.data(), N, cfg, gate.data(), nullptr, nullptr, MoeStep{});
  for (int32_t e : r.selected) first += e == 0, last += e == cfg.E - 1;
  EXPECT_GT(first, 2 * last);
}

TEST(ExpertCapacity, IsCeilOfNKOverETimesCf) {
  EXPECT_EQ(expert_capacity(7, 2, 4, 1.0f), 4);   // 3.5
  EXPECT_EQ(expert_capacity(7, 2, 4, 0.5f), 2);   // 1.75
  EXPECT_EQ(expert_capacity(7, 2, 4, 0.25f), 1);  // 0.875
  EXPECT_EQ(expert_capacity(4096, 2, 8, 1.0f), 1024);
  EXPECT_EQ(expert_capacity(4096, 2, 8, 1.25f), 1280);
  EXPECT_EQ(expert_capacity(4096, 2, 8, 1.1f), 1127);  // 1126.40002...: float 1.1 is a bit above
  EXPECT_EQ(expert_capacity(10, 1, 3, 1.0f), 4);
  EXPECT_EQ(expert_capacity(12, 1, 3, 1.0f), 4);  // exact: no spurious round-up
  EXPECT_EQ(expert_capacity(7, 2, 4, 0.0f), 0);
  EXPECT_EQ(expert_capacity(0, 2, 4, 1.0f), 0);
  EXPECT_EQ(expert_capacity(5, 2, 1, 1.0f), 5);  // clamped to N
  EXPECT_THROW(expert_capacity(5, 0, 1, 1.0f), Error);
  EXPECT_THROW(expert_capacity(5, 1, 1, -1.0f), Error);
}

TEST(TopK, DescendingWithTiesToTheLowerIndex) {
  const float key[] = {1.0f, 3.0f, 3.0f, 2.0f, 3.0f};
  int32_t idx[5];
  float vals[5];
  topk_indices(idx, vals, key, 5, 2);
  EXPECT_EQ(idx[0], 1);
  EXPECT_EQ(idx[1], 2);
  topk_indices(idx, vals, key, 5, 5);
  const int32_t all[] = {1, 2, 4, 3, 0};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(idx[i], all[i]) << i;
  topk_indices(idx, vals, key, 5, 1);
  EXPECT_EQ(idx[0], 1);
}

// Identical tokens: every expert's scores tie, so each takes the lowest token indices.
TEST(ExpertChoice, TakesTopCapacityTokensTiesToLowerIndex) {
  MoeConfig cfg = valid_config();
  cfg.E = 3, cfg.K = 1, cfg.router = RouterKind::ExpertChoice;
  const int64_t N = 6;
  std::vector<float> inp(N * cfg.C, 0.5f), gate = random_vector(cfg.E * cfg.C, 3);
  Routing r;
  RouterCache cache;
  router_forward(r, cache, inp.data(), N, cfg, gate.data(), nullptr, nullptr, MoeStep{});
  ASSERT_EQ(r.S, 3);
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t e = 0; e < 3; ++e) {
      EXPECT_EQ(r.selected[t * 3 + e], t < 2 ? e : -1) << t << "," << e;
      EXPECT_FLOAT_EQ(r.weight[t * 3 + e], t < 2 ? cache.probs[t * 3 + e] : 0.0f);
    }
  }
  // capacity_factor 2: ceil(6·1/3·2) = 4 tokens per expert.
  cfg.capacity_factor = 2.0f;
  router_forward(r, cache, inp.data(), N, cfg, gate.data(), nullptr, nullptr, MoeStep{});
  for (int64_t t = 0; t < N; ++t) EXPECT_EQ(r.selected[t * 3], t < 4 ? 0 : -1) << t;
}

// Experts 1 and 2 have the same gate row, so their logits tie on every token.
TEST(TopKSoftmax, TiedLogitsGoToTheLowerExpert) {
  MoeConfig cfg = valid_config();
  cfg.K = 1;
  const int64_t N = 5;
  std::vector<float> inp = random_vector(N * cfg.C, 4), gate(cfg.E * cfg.C, 0.0f);
  for (int64_t c = 0; c < cfg.C; ++c) gate[1 * cfg.C + c] = gate[2 * cfg.C + c] = inp[c] * 4.0f;
  Routing r;
  RouterCache cache;
  router_forward(r, cache, inp.data(), N, cfg, gate.data(), nullptr, nullptr, MoeStep{});
  EXPECT_EQ(r.selected[0], 1);  // token 0 aligns with rows 1 and 2
  EXPECT_EQ(r.weight[0], 1.0f);
}

TEST(SigmoidBias, BiasSteersSelectionButNotWeights) {
  MoeConfig cfg = valid_config();
  cfg.router = RouterKind::SigmoidBias;
  const int64_t N = 9;
  std::vector<float> inp = random_vector(N * cfg.C, 5), gate = random_vector(cfg.E * cfg.C, 6);
  std::vector<float> bias = {0.0f, 0.0f, 0.0f, 10.0f};
  Routing r;
  RouterCache cache;
  router_forward(r, cache, inp.data(), N, cfg, gate.data(), nullptr, bias.data(), MoeStep{});
  for (int64_t t = 0; t < N; ++t) {
    EXPECT_EQ(r.selected[t * 2], 3) << t;  // the bias wins every token
    const float* s = cache.probs.data() + t * cfg.E;
    int32_t other = r.selected[t * 2 + 1];
    float sum = s[3] + s[other];
    EXPECT_FLOAT_EQ(r.weight[t * 2], s[3] / sum);
    EXPECT_FLOAT_EQ(r.weight[t * 2 + 1], s[other] / sum);
    EXPECT_NEAR(s[3], 1.0 / (1.0 + std::exp(-double(cache.logits[t * cfg.E + 3]))), 1e-6);
  }
}

// Every token's experts lie in at most M groups, and those are its best M by the sum of its top-K
// scores in each group; without the limit some token would route elsewhere.
TEST(GroupLimited, TokensStayInTheirBestGroups) {
  MoeConfig cfg = valid_config();
  cfg.E = 8, cfg.K = 2, cfg.route_groups = 4, cfg.route_group_topk = 2;
  const int64_t N = 64, Eg = 2;
  std::vector<float> inp = random_vector(N * cfg.C, 7), gate = random_vector(cfg.E * cfg.C, 8),
                     noise = random_vector(cfg.E * cfg.C, 9), bias = random_vector(cfg.E, 10, 0.3f);
  for (RouterKind kind :
       {RouterKind::TopKSoftmax, RouterKind::NoisyTopK, RouterKind::SigmoidBias}) {
    cfg.router = kind;
    MoeConfig off = cfg;
    off.route_groups = 0;
    Routing r, r_off;
    RouterCache cache, cache_off;
    const MoeStep step{true, 11, 3, 0};
    router_forward(r, cache, inp.data(), N, cfg, gate.data(), noise.data(), bias.data(), step);
    router_forward(r_off, cache_off, inp.data(), N, off, gate.data(), noise.data(), bias.data(),
                   step);
    int64_t moved = 0;
    for (int64_t t = 0; t < N; ++t) {
      // The group scores from the layer's own scores (for sigmoid_bias: s + b).
      std::vector<double> gs(4, 0.0);
      for (int64_t g = 0; g < 4; ++g) {
        for (int64_t j = 0; j < Eg; ++j) {
          const int64_t e = g * Eg + j;
          gs[g] += cache.probs[t * cfg.E + e] + (kind == RouterKind::SigmoidBias ? bias[e] : 0.0);
        }
      }
      std::vector<double> sorted = gs;
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      for (int64_t k = 0; k < cfg.K; ++k) {
        const int32_t e = r.selected[t * cfg.K + k];
        EXPECT_GE(gs[e / Eg], sorted[1] - 1e-6) << router_kind_name(kind) << " token " << t;
        EXPECT_GT(r.weight[t * cfg.K + k], 0.0f);
      }
      moved += r.selected[t * cfg.K] != r_off.selected[t * cfg.K] ||
               r.selected[t * cfg.K + 1] != r_off.selected[t * cfg.K + 1];
    }
    EXPECT_GT(moved, 0) << router_kind_name(kind);
    EXPECT_LT(moved, N) << router_kind_name(kind);
  }
}

TEST(Router, RejectsMissingWeights) {
  MoeConfig cfg = valid_config();
  std::vector<float> inp(2 * cfg.C, 1.0f), gate(cfg.E * cfg.C, 1.0f);
  Routing r;
  RouterCache cache;
  cfg.router = RouterKind::NoisyTopK;
  EXPECT_THROW(
      router_forward(r, cache, inp.data(), 2, cfg, gate.data(), nullptr, nullptr, MoeStep{}),
      Error);
  cfg.router = RouterKind::SigmoidBias;
  EXPECT_THROW(
      router_forward(r, cache, inp.data(), 2, cfg, gate.data(), nullptr, nullptr, MoeStep{}),
      Error);
  cfg.router = RouterKind::TopKSoftmax;
  EXPECT_THROW(
      router_forward(r, cache, inp.data(), -1, cfg, gate.data(), nullptr, nullptr, MoeStep{}),
      Error);
}
