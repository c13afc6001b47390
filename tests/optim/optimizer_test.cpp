#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/check.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "support/expect_error.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// Straightforward double-precision version of each PyTorch update rule, one element at a time.
struct Reference {
  OptimizerConfig c;
  std::vector<bool> decay;
  std::vector<double> p, m, v, buf, ga;
  int64_t t = 0;

  Reference(const OptimizerConfig& config, const std::vector<bool>& decay_mask,
            const std::vector<float>& params)
      : c(config), decay(decay_mask), p(params.begin(), params.end()) {
    const size_t n = params.size();
    m.assign(n, 0.0);
    v.assign(n,
             c.kind == OptimizerKind::AdaGrad ? double(float(c.initial_accumulator_value)) : 0.0);
    buf.assign(n, 0.0);
    ga.assign(n, 0.0);
  }

  void step(const std::vector<float>& grads, double lr) {
    ++t;
    for (size_t i = 0; i < p.size(); ++i) {
      double g = grads[i];
      const double wd = decay[i] ? c.weight_decay : 0.0;
      switch (c.kind) {
        case OptimizerKind::AdamW: {
          p[i] -= lr * wd * p[i];
          m[i] = c.beta1 * m[i] + (1 - c.beta1) * g;
          v[i] = c.beta2 * v[i] + (1 - c.beta2) * g * g;
          const double mh = m[i] / (1 - std::pow(c.beta1, double(t)));
          const double vh = v[i] / (1 - std::pow(c.beta2, double(t)));
          p[i] -= lr * mh / (std::sqrt(vh) + c.eps);
          break;
        }
        case OptimizerKind::Sgd:
          g += wd * p[i];
          if (c.momentum != 0) {
            buf[i] = t == 1 ? g : c.momentum * buf[i] + g;
            g = c.nesterov ? g + c.momentum * buf[i] : buf[i];
          }
          p[i] -= lr * g;
          break;
        case OptimizerKind::AdaGrad: {
          g += wd * p[i];
          v[i] += g * g;
          const double clr = lr / (1 + double(t - 1) * c.lr_decay);
          p[i] -= clr * g / (std::sqrt(v[i]) + c.eps);
          break;
        }
        case OptimizerKind::RmsProp: {
          g += wd * p[i];
          v[i] = c.alpha * v[i] + (1 - c.alpha) * g * g;
          double avg;
          if (c.centered) {
            ga[i] = c.alpha * ga[i] + (1 - c.alpha) * g;
            avg = std::sqrt(v[i] - ga[i] * ga[i]);
          } else {
            avg = std::sqrt(v[i]);
          }
          avg += c.eps;
          if (c.momentum != 0) {
            buf[i] = c.momentum * buf[i] + g / avg;
            p[i] -= lr * buf[i];
          } else {
            p[i] -= lr * g / avg;
          }
          break;
        }
      }
    }
  }

  const std::vector<double>& state(const std::string& name) const {
    if (name == "exp_avg") return m;
    if (name == "exp_avg_sq" || name == "sum_sq" || name == "square_avg") return v;
    if (name == "momentum") return buf;
    if (name == "grad_avg") return ga;
    ADD_FAILURE() << "unknown state " << name;
    return m;
  }
};

struct Case {
  std::string label;
  OptimizerConfig config;
  double lr;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.label;
}

OptimizerConfig with(OptimizerKind kind, void (*edit)(OptimizerConfig&)) {
  OptimizerConfig c = default_optimizer_config(kind);
  edit(c);
  return c;
}

std::vector<Case> all_cases() {
  using K = OptimizerKind;
  return {
      {"adamw", default_optimizer_config(K::AdamW), 1e-2},
      {"adamw_no_decay", with(K::AdamW, [](OptimizerConfig& c) { c.weight_decay = 0; }), 1e-2},
      {"adamw_betas", with(K::AdamW, [](OptimizerConfig& c) { c.beta1 = 0.5, c.beta2 = 0.999; }),
       3e-2},
      {"sgd", default_optimizer_config(K::Sgd), 5e-2},
      {"sgd_plain", with(K::Sgd, [](OptimizerConfig& c) { c.momentum = 0; }), 5e-2},
      {"sgd_nesterov_decay",
       with(K::Sgd, [](OptimizerConfig& c) { c.nesterov = true, c.weight_decay = 0.05; }), 5e-2},
      {"adagrad", default_optimizer_config(K::AdaGrad), 5e-2},
      {"adagrad_decay_lrdecay_init",
       with(K::AdaGrad,
            [](OptimizerConfig& c) {
              c.weight_decay = 0.1, c.lr_decay = 0.05;
              c.initial_accumulator_value = 0.3;
            }),
       5e-2},
      {"rmsprop", default_optimizer_config(K::RmsProp), 1e-2},
      {"rmsprop_momentum_centered_decay",
       with(K::RmsProp,
            [](OptimizerConfig& c) {
              c.momentum = 0.9, c.centered = true;
              c.weight_decay = 0.1, c.alpha = 0.9;
            }),
       1e-2},
  };
}

// Groups of mixed flags with sizes that tile [0, n) (the last one absorbs the rest).
std::vector<ParamRange> make_groups(int64_t n) {
  std::vector<ParamRange> groups;
  const int64_t sizes[] = {100, 10, 190, 1, 1, 7};
  int64_t off = 0;
  bool flag = true;
  for (int64_t s : sizes) {
    s = std::min(s, n - off);
    groups.push_back({off, s, flag});
    off += s;
    flag = !flag;
  }
  groups.push_back({off, n - off, flag});
  return groups;
}

std::vector<bool> decay_mask(const std::vector<ParamRange>& groups, int64_t n) {
  std::vector<bool> mask(n);
  for (const ParamRange& g : groups) {
    for (int64_t i = g.offset; i < g.offset + g.size; ++i) mask[i] = g.weight_decay;
  }
  return mask;
}

float step_lr(const Case& c, int s) {
  return static_cast<float>(c.lr * (1.0 + 0.25 * s));
}

std::vector<float> step_grads(int64_t n, int s) {
  return random_vector(n, 1000 + s);
}

void expect_bitwise(const float* a, const float* b, int64_t n, const std::string& what) {
  int64_t first = -1;
  for (int64_t i = 0; i < n && first < 0; ++i) {
    if (std::memcmp(a + i, b + i, sizeof(float)) != 0) first = i;
  }
  EXPECT_EQ(first, -1) << what << ": first differing element " << first << " (" << a[first]
                       << " vs " << b[first] << ")";
}

// State of a list of optimizers over consecutive ranges, concatenated by name.
std::vector<float> joined_state(const std::vector<Optimizer*>& parts, const std::string& name) {
  std::vector<float> out;
  for (Optimizer* o : parts) {
    for (const StateBuffer& s : o->state()) {
      if (s.name == name) out.insert(out.end(), s.values.begin(), s.values.end());
    }
  }
  return out;
}

class OptimizerTest : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST_P(OptimizerTest, MatchesDoubleReference) {
  const Case& c = GetParam();
  for (int64_t n : {0, 1, 333}) {
    auto groups = make_groups(n);
    auto params = random_vector(n, 7);
    Reference ref(c.config, decay_mask(groups, n), params);
    auto opt = make_optimizer(c.config, groups, 0, n);
    for (int s = 0; s < 6; ++s) {
      auto grads = step_grads(n, s);
      const float lr = step_lr(c, s);
      opt->step(params.data(), grads.data(), lr);
      ref.step(grads, lr);
    }
    EXPECT_EQ(opt->step_count(), 6);
    expect_close(params.data(), ref.p.data(), n, 1e-6, 1e-5, (c.label + " params").c_str());
    for (const StateBuffer& s : opt->state()) {
      ASSERT_EQ(int64_t(s.values.size()), n) << s.name;
      // Moments are sums of O(1) gradients that may cancel: absolute error on their scale.
      expect_close(s.values.data(), ref.state(s.name).data(), n, 1e-6, 1e-5,
                   (c.label + " " + s.name).c_str());
    }
  }
}

TEST_P(OptimizerTest, SubRangesGiveBitwiseSameResult) {
  const Case& c = GetParam();
  const int64_t n = 1000;
  auto groups = make_groups(n);
  auto whole_params = random_vector(n, 8);
  auto whole = make_optimizer(c.config, groups, 0, n);
  std::vector<std::vector<float>> grads;
  for (int s = 0; s < 4; ++s) {
    grads.push_back(step_grads(n, s));
    whole->step(whole_params.data(), grads[s].data(), step_lr(c, s));
  }
  // Splits inside a group, on group boundaries, at odd and at the ends.
  for (int64_t k : {0, 1, 5, 100, 137, 301, 999, 1000}) {
    auto params = random_vector(n, 8);
    auto lo = make_optimizer(c.config, groups, 0, k);
    auto hi = make_optimizer(c.config, groups, k, n);
    for (int s = 0; s < 4; ++s) {
      lo->step(params.data(), grads[s].data(), step_lr(c, s));
      hi->step(params.data() + k, grads[s].data() + k, step_lr(c, s));
    }
    const std::string where = c.label + " split at " + std::to_string(k);
    expect_bitwise(params.data(), whole_params.data(), n, where + " params");
    for (const StateBuffer& s : whole->state()) {
      auto joined = joined_state({lo.get(), hi.get()}, s.name);
      ASSERT_EQ(int64_t(joined.size()), n) << where << " " << s.name;
      expect_bitwise(joined.data(), s.values.data(), n, where + " " + s.name);
    }
  }
}

TEST_P(OptimizerTest, ThreadCountDoesNotChangeBits) {
  const Case& c = GetParam();
  const int64_t n = 70001;  // above the parallel threshold, odd
  auto groups = make_groups(n);
  const int saved = omp_get_max_threads();
  std::vector<std::vector<float>> params, states;
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    auto p = random_vector(n, 9);
    // Two ranks' worth: the split point lands inside a group and off any alignment.
    auto opt = make_optimizer(c.config, groups, 0, n);
    auto part = make_optimizer(c.config, groups, 33333, n);
    auto q = p;
    for (int s = 0; s < 3; ++s) {
      auto g = step_grads(n, s);
      opt->step(p.data(), g.data(), step_lr(c, s));
      part->step(q.data() + 33333, g.data() + 33333, step_lr(c, s));
    }
    expect_bitwise(q.data() + 33333, p.data() + 33333, n - 33333, c.label + " part vs whole");
    params.push_back(p);
    std::vector<float> st;
    for (const StateBuffer& s : opt->state()) st.insert(st.end(), s.values.begin(), s.values.end());
    states.push_back(st);
  }
  omp_set_num_threads(saved);
  expect_bitwise(params[0].data(), params[1].data(), n, c.label + " params 1 vs 2 threads");
  ASSERT_EQ(states[0].size(), states[1].size());
  expect_bitwise(states[0].data(), states[1].data(), int64_t(states[0].size()),
                 c.label + " state 1 vs 2 threads");
}

TEST_P(OptimizerTest, StateRoundTripResumesBitwise) {
  const Case& c = GetParam();
  const int64_t n = 257;
  auto groups = make_groups(n);
  auto params = random_vector(n, 10);
  auto a = make_optimizer(c.config, groups, 0, n);
  for (int s = 0; s < 3; ++s) a->step(params.data(), step_grads(n, s).data(), step_lr(c, s));
  // What a checkpoint does: copy every named buffer and the step count into a fresh instance.
  auto b = make_optimizer(c.config, groups, 0, n);
  auto sa = a->state();
  auto sb = b->state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    ASSERT_EQ(sa[i].name, sb[i].name);
    std::copy(sa[i].values.begin(), sa[i].values.end(), sb[i].values.begin());
  }
  b->set_step_count(a->step_count());
  auto resumed = params;
  for (int s = 3; s < 5; ++s) {
    auto g = step_grads(n, s);
    a->step(params.data(), g.data(), step_lr(c, s));
    b->step(resumed.data(), g.data(), step_lr(c, s));
  }
  expect_bitwise(resumed.data(), params.data(), n, c.label + " resumed params");
}

// Minimises f(x) = ½ Σ a_i (x_i − c_i)² under a warmup + cosine schedule.
TEST_P(OptimizerTest, ConvergesOnQuadratic) {
  const Case& c = GetParam();
  const int64_t n = 64;
  auto curv = random_vector(n, 11), centre = random_vector(n, 12, 2.0f);
  for (float& a : curv) a = 1.0f + 0.5f * std::tanh(a);  // in (0.5, 1.5)
  std::vector<ParamRange> groups{{0, n, false}};         // decay would move the minimum
  auto loss = [&](const std::vector<float>& x) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += 0.5 * curv[i] * std::pow(double(x[i]) - centre[i], 2);
    return s;
  };
  ScheduleConfig sc;
  sc.kind = ScheduleKind::Cosine;
  sc.lr = c.config.kind == OptimizerKind::Sgd       ? 0.1
          : c.config.kind == OptimizerKind::AdaGrad ? 2.0
                                                    : 0.05;
  sc.warmup_steps = 10;
  sc.total_steps = 400;
  LrSchedule schedule(sc);
  std::vector<float> x(n, 0.0f), g(n);
  const double start = loss(x);
  auto opt = make_optimizer(c.config, groups, 0, n);
  for (int64_t s = 0; s < sc.total_steps; ++s) {
    for (int64_t i = 0; i < n; ++i) g[i] = curv[i] * (x[i] - centre[i]);
    opt->step(x.data(), g.data(), static_cast<float>(schedule.lr(s)));
  }
  EXPECT_LT(loss(x), start * 1e-3) << c.label << " from " << start;
}

INSTANTIATE_TEST_SUITE_P(Kinds, OptimizerTest, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return info.param.label; });

TEST(DecaySegments, IntersectsAndMerges) {
  // Unsorted on purpose: the order of the list does not matter, only the tiling.
  std::vector<ParamRange> groups{
      {10, 5, false}, {0, 10, true}, {15, 0, true}, {15, 5, false}, {20, 30, true}};
  EXPECT_EQ(param_ranges_total(groups), 50);
  auto all = decay_segments(groups, 0, 50);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].begin, 0);
  EXPECT_EQ(all[0].end, 10);
  EXPECT_TRUE(all[0].weight_decay);
  EXPECT_EQ(all[1].begin, 10);
  EXPECT_EQ(all[1].end, 20);  // [10,15) and [15,20) merged
  EXPECT_FALSE(all[1].weight_decay);
  EXPECT_EQ(all[2].end, 50);
  auto mid = decay_segments(groups, 12, 23);  // relative to 12
  ASSERT_EQ(mid.size(), 2u);
  EXPECT_EQ(mid[0].begin, 0);
  EXPECT_EQ(mid[0].end, 8);
  EXPECT_FALSE(mid[0].weight_decay);
  EXPECT_EQ(mid[1].begin, 8);
  EXPECT_EQ(mid[1].end, 11);
  EXPECT_TRUE(mid[1].weight_decay);
  EXPECT_TRUE(decay_segments(groups, 20, 20).empty());
  EXPECT_TRUE(decay_segments({}, 0, 0).empty());
  auto one = decay_segments(groups, 49, 50);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].end, 1);
}

namespace {}  // namespace

TEST(DecaySegments, RejectsBadTilingAndRanges) {
  std::vector<ParamRange> gap{{0, 10, true}, {11, 5, false}};
  expect_error([&] { decay_segments(gap, 0, 5); }, "gap");
  std::vector<ParamRange> overlap{{0, 10, true}, {9, 5, false}};
  expect_error([&] { decay_segments(overlap, 0, 5); }, "overlap");
  std::vector<ParamRange> negative{{0, -1, true}};
  expect_error([&] { param_ranges_total(negative); }, "size -1");
  std::vector<ParamRange> ok{{0, 10, true}};
  expect_error([&] { decay_segments(ok, 0, 11); }, "[0, 11)");
  expect_error([&] { decay_segments(ok, 5, 4); }, "[5, 4)");
  expect_error([&] { make_optimizer(OptimizerConfig{}, ok, -1, 3); }, "[-1, 3)");
}

TEST(OptimizerConfig, ParsesNamesAndDefaults) {
  EXPECT_EQ(parse_optimizer_kind("adamw"), OptimizerKind::AdamW);
  EXPECT_EQ(parse_optimizer_kind("sgd"), OptimizerKind::Sgd);
  EXPECT_EQ(parse_optimizer_kind("adagrad"), OptimizerKind::AdaGrad);
  EXPECT_EQ(parse_optimizer_kind("rmsprop"), OptimizerKind::RmsProp);
  expect_error([] { parse_optimizer_kind("adam"); }, "adamw, sgd, adagrad, rmsprop");
  for (auto k :
       {OptimizerKind::AdamW, OptimizerKind::Sgd, OptimizerKind::AdaGrad, OptimizerKind::RmsProp}) {
    EXPECT_EQ(parse_optimizer_kind(optimizer_kind_name(k)), k);
    EXPECT_NO_THROW(default_optimizer_config(k).validate());
  }
  auto adamw = default_optimizer_config("adamw");
  EXPECT_EQ(adamw.beta1, 0.9);
  EXPECT_EQ(adamw.beta2, 0.95);
  EXPECT_EQ(adamw.eps, 1e-8);
  EXPECT_EQ(adamw.weight_decay, 0.1);
  EXPECT_EQ(default_optimizer_config("adagrad").eps, 1e-10);
  EXPECT_EQ(default_optimizer_config("rmsprop").alpha, 0.99);
}

TEST(OptimizerConfig, BadValuesNameTheField) {
  struct Bad {
    void (*edit)(OptimizerConfig&);
    const char* needle;
  };
  const Bad bad[] = {
      {[](OptimizerConfig& c) { c.beta1 = 1.0; }, "beta1 = 1"},
      {[](OptimizerConfig& c) { c.beta1 = -0.1; }, "beta1 = -0.1"},
      {[](OptimizerConfig& c) { c.beta2 = 1.5; }, "beta2 = 1.5"},
      {[](OptimizerConfig& c) { c.beta2 = NAN; }, "beta2 = nan"},
      {[](OptimizerConfig& c) { c.eps = 0; }, "eps = 0"},
      {[](OptimizerConfig& c) { c.eps = -1e-8; }, "eps = -1e-08"},
      {[](OptimizerConfig& c) { c.weight_decay = -0.1; }, "weight_decay = -0.1"},
      {[](OptimizerConfig& c) { c.momentum = -0.5; }, "momentum = -0.5"},
      {[](OptimizerConfig& c) { c.momentum = 1.0; }, "momentum = 1"},
      {[](OptimizerConfig& c) { c.nesterov = true, c.momentum = 0; }, "nesterov"},
      {[](OptimizerConfig& c) { c.alpha = 1.2; }, "alpha = 1.2"},
      {[](OptimizerConfig& c) { c.lr_decay = -1; }, "lr_decay = -1"},
      {[](OptimizerConfig& c) { c.initial_accumulator_value = -1; }, "initial_accumulator_value"},
      {[](OptimizerConfig& c) { c.eps = INFINITY; }, "eps = inf"},
  };
  std::vector<ParamRange> groups{{0, 4, true}};
  for (const Bad& b : bad) {
    OptimizerConfig c;
    b.edit(c);
    expect_error([&] { c.validate(); }, b.needle);
    expect_error([&] { make_optimizer(c, groups, 0, 4); }, b.needle);
  }
}

TEST(OptimizerStep, RejectsBadLearningRate) {
  std::vector<ParamRange> groups{{0, 4, true}};
  auto opt = make_optimizer(OptimizerConfig{}, groups, 0, 4);
  std::vector<float> p(4), g(4);
  expect_error([&] { opt->step(p.data(), g.data(), -1e-3f); }, "lr = -0.001");
  expect_error([&] { opt->step(p.data(), g.data(), NAN); }, "lr = nan");
  expect_error([&] { opt->set_step_count(-2); }, "-2");
  EXPECT_EQ(opt->step_count(), 0);
}

TEST(OptimizerState, NamesPerKind) {
  std::vector<ParamRange> groups{{0, 3, true}, {3, 2, false}};
  auto names = [&](const OptimizerConfig& c) {
    std::string s;
    auto opt = make_optimizer(c, groups, 1, 4);
    for (const StateBuffer& b : opt->state()) {
      EXPECT_EQ(b.values.size(), 3u) << b.name;
      s += b.name + ",";
    }
    return s;
  };
  EXPECT_EQ(names(default_optimizer_config("adamw")), "exp_avg,exp_avg_sq,");
  EXPECT_EQ(names(default_optimizer_config("sgd")), "momentum,");
  auto plain = default_optimizer_config("sgd");
  plain.momentum = 0;
  EXPECT_EQ(names(plain), "");
  EXPECT_EQ(names(default_optimizer_config("adagrad")), "sum_sq,");
  auto rms = default_optimizer_config("rmsprop");
  EXPECT_EQ(names(rms), "square_avg,");
  rms.momentum = 0.5, rms.centered = true;
  EXPECT_EQ(names(rms), "square_avg,momentum,grad_avg,");
}
