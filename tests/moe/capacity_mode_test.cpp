// Tutel's capacity modes of the MoE layer against a hand computation: cf > 0 fixed, cf = 0
// dropless, cf < 0 min(ceil(N·K/E·|cf|), the largest load an expert needs).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/check.h"
#include "moe/moe_layer.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// C = E = 4, K = 1 and a gate of identity: a token that is one-hot in dimension d goes to expert
// d. Six tokens to experts 0, 0, 0, 0, 1, 2: loads (4, 1, 1, 0), the largest need is 4.
struct Skewed {
  MoeConfig cfg;
  std::vector<float> params, inp;
  MoeWeights w;
  static constexpr int64_t N = 6;

  explicit Skewed(float cf) {
    cfg.C = 4, cfg.F = 3, cfg.E = 4, cfg.K = 1, cfg.capacity_factor = cf;
    params = random_vector(moe_param_sizes(cfg).total(), 77, 0.5f);
    w = moe_weights_from_buffer(cfg, params.data());
    std::fill(w.gate, w.gate + cfg.E * cfg.C, 0.0f);
    for (int64_t e = 0; e < cfg.E; ++e) w.gate[e * cfg.C + e] = 1.0f;
    const int dims[N] = {0, 0, 0, 0, 1, 2};
    inp.assign(N * cfg.C, 0.0f);
    for (int64_t t = 0; t < N; ++t) inp[t * cfg.C + dims[t]] = 1.0f;
  }

  std::vector<float> run(MoeLayer& layer) {
    std::vector<float> out(N * cfg.C);
    layer.forward(out.data(), inp.data(), N, w, MoeStep{});
    return out;
  }
};

}  // namespace

TEST(CapacityMode, NegativeFactorCapsAtTheLoadNeeded) {
  struct Expect {
    float cf;
    int64_t capacity, dropped;
  };
  // bound = ceil(6·1/4·|cf|): 0.5 → 1, 1 → 2, 3 → 5 (above the need of 4, so 4).
  for (const Expect& x : {Expect{-0.5f, 1, 3}, Expect{-1.0f, 2, 2}, Expect{-3.0f, 4, 0}}) {
    Skewed s(x.cf);
    MoeLayer layer(s.cfg);
    s.run(layer);
    const MoeStats& st = layer.stats();
    EXPECT_EQ(st.needed, 4) << x.cf;
    EXPECT_EQ(st.capacity, x.capacity) << x.cf;
    EXPECT_EQ(st.dropped, x.dropped) << x.cf;
    EXPECT_EQ(st.capacity_factor, x.cf);
    EXPECT_EQ(st.tokens_per_expert[0], std::min<int64_t>(4, x.capacity));
  }
}

TEST(CapacityMode, FixedAndDroplessAsBefore) {
  Skewed fixed(3.0f);
  MoeLayer a(fixed.cfg);
  fixed.run(a);
  EXPECT_EQ(a.stats().capacity, 5);  // the bound itself, not the need
  EXPECT_EQ(a.stats().dropped, 0);
  Skewed dropless(0.0f);
  MoeLayer b(dropless.cfg);
  const std::vector<float> out0 = dropless.run(b);
  EXPECT_EQ(b.stats().capacity, 0);
  EXPECT_EQ(b.stats().needed, 4);
  // A capped factor that drops nothing computes exactly what dropless computes.
  Skewed capped(-3.0f);
  MoeLayer c(capped.cfg);
  EXPECT_EQ(capped.run(c), out0);
}

TEST(CapacityMode, SetFactorChangesTheNextForward) {
  Skewed s(-3.0f);
  MoeLayer layer(s.cfg);
  layer.set_capacity_factor(-1.0f);
  s.run(layer);
  EXPECT_EQ(layer.stats().capacity, 2);
  EXPECT_EQ(layer.stats().capacity_factor, -1.0f);
  layer.set_capacity_factor(0.5f);  // fixed: ceil(0.75) = 1
  s.run(layer);
  EXPECT_EQ(layer.stats().capacity, 1);
  EXPECT_EQ(layer.stats().dropped, 3);
}

TEST(CapacityMode, ExpertChoiceRefusesANegativeFactor) {
  MoeConfig cfg;
  cfg.C = 4, cfg.F = 3, cfg.E = 4, cfg.K = 1, cfg.router = RouterKind::ExpertChoice;
  cfg.capacity_factor = -1.0f;
  EXPECT_THROW(cfg.validate(), Error);
  cfg.capacity_factor = 1.0f;
  MoeLayer layer(cfg);
  EXPECT_THROW(layer.set_capacity_factor(2.0f), Error);
}
