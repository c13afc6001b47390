// The MoE classifier: the forward against a naive double-precision model, every parameter group's
// gradient by finite differences (every router), layout names, bad input.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <set>
#include <vector>

#include "core/check.h"
#include "model/classifier.h"
#include "moe/moe_reference.h"
#include "support/error_bound.h"
#include "support/gradcheck.h"
#include "support/small_models.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

ClassifierConfig tiny_config(const std::string& router = "topk_softmax") {
  // top-k = every expert: routing is smooth, so finite differences are meaningful everywhere.
  ClassifierConfig c = moetrain::testing::small_classifier(4);
  c.router = parse_router_setting(router);
  c.shared_expert_hidden = 8;
  c.init_std = 0.3;  // larger weights than training uses: gradients well above float noise
  c.aux_loss_coef = 0.1;
  c.z_loss_coef = 0.05;
  return c;
}

// Input projection and head past the small-product cut-off, with a partial column block.
ClassifierConfig wide_config() {
  ClassifierConfig c = tiny_config();
  c.input_dim = 100;
  c.dim = 48;
  c.n_classes = 37;
  c.n_layers = 1;
  return c;
}

std::vector<float> make_params(const Classifier& model, uint64_t seed) {
  const ClassifierLayout& layout = model.layout();
  std::vector<float> params(layout.size());
  init_classifier_params(params.data(), layout, model.config(), seed);
  // Norm weights away from 1 and a non-zero bias, so their gradients are exercised non-trivially.
  for (const auto& p : layout.params())
    if (p.shape.size() == 1)
      for (int64_t i = 0; i < p.numel; ++i)
        params[p.offset + i] =
            (p.name.ends_with(".bias") ? 0.0f : 1.0f) + 0.1f * std::sin(float(i + p.offset));
  return params;
}

MoeWeights views(float* base, const ClassifierBlockOffsets& o) {
  auto at = [base](int64_t off) { return off < 0 ? nullptr : base + off; };
  MoeWeights w;
  w.gate = at(o.gate), w.noise = at(o.noise), w.w1 = at(o.w1), w.w3 = at(o.w3), w.w2 = at(o.w2);
  w.shared_w1 = at(o.shared_w1), w.shared_w3 = at(o.shared_w3), w.shared_w2 = at(o.shared_w2);
  return w;
}

struct Reference {
  std::vector<Bounded> logits;  // (N, V)
  Bounded ce, aux, z, total;
  int64_t correct = 0;
};

// RMSNorm, y_c = w_c·x_c·r with r = (mean(x²) + eps)^(-1/2), of rows that the model holds
// within in[i].e of in[i].v: mean(x²) moves by at most Σ(2|x|e + e²)/C, r by the largest slope
// of t^(-1/2) over that range times as much, and y_c by |w_c|·(|x_c|Δr + r·e_c + e_c·Δr); the
// kernel adds the rounding of r and eps to float and of its two multiplies.
std::vector<Bounded> rmsnorm_bounded(const std::vector<Bounded>& in, const float* w, int64_t N,
                                     int64_t C, double eps) {
  std::vector<Bounded> out(N * C);
  for (int64_t i = 0; i < N; ++i) {
    const Bounded* x = in.data() + i * C;
    double ms = 0, dms = 0;
    for (int64_t c = 0; c < C; ++c) {
      ms += x[c].v * x[c].v / double(C);
      dms += (2 * std::abs(x[c].v) + x[c].e) * x[c].e / double(C);
    }
    const double r = 1.0 / std::sqrt(ms + eps);
    const double dr = 0.5 * std::pow(std::max(ms - dms, 0.0) + eps, -1.5) * dms;
    for (int64_t c = 0; c < C; ++c) {
      const double v = double(w[c]) * x[c].v * r;
      const double carried = std::abs(w[c]) * (std::abs(x[c].v) * dr + (r + dr) * x[c].e);
      out[i * C + c] = {v, carried + gamma_n(4) * (std::abs(v) + carried)};
    }
  }
  return out;
}

// The whole classifier in double, token by token, with the bound of the model's float forward
// (support/error_bound.h); the MoE layers through moe_reference.h, which takes its input as
// float: the reference's stream rounded, with the model's distance from that as input error.
Reference reference(const ClassifierConfig& cfg, const ClassifierLayout& layout,
                    std::vector<float>& params, const std::vector<float>& x,
                    const std::vector<int32_t>& labels, int64_t N, const MoeStep& step) {
  const int64_t C = cfg.dim, D = cfg.input_dim, V = cfg.n_classes, L = cfg.n_layers;
  const double eps = cfg.norm_eps;
  const float* P = params.data();
  // Input projection, then the bias added to it: one sum of D + 1 terms.
  std::vector<Bounded> h(N * C);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) {
      BoundedSum s;
      for (int64_t d = 0; d < D; ++d) s.add(P[layout.input_proj + c * D + d], x[i * D + d]);
      if (layout.input_bias >= 0) s.add(Bounded{P[layout.input_bias + c]});
      h[i * C + c] = s.result();
    }
  Reference ref;
  std::vector<float> bias(cfg.n_experts, 0.0f);
  for (int64_t l = 0; l < L; ++l) {
    const std::vector<Bounded> ln = rmsnorm_bounded(h, P + layout.blocks[l].norm, N, C, eps);
    std::vector<float> lnf(N * C);
    std::vector<double> ln_err(N * C);
    for (int64_t i = 0; i < N * C; ++i) {
      lnf[i] = static_cast<float>(ln[i].v);
      ln_err[i] = ln[i].e + std::abs(double(lnf[i]) - ln[i].v);
    }
    MoeStep s = step;
    s.layer = static_cast<uint64_t>(l);
    MoeReference m = moe_reference(cfg.moe(), lnf.data(), N, views(params.data(), layout.blocks[l]),
                                   bias.data(), s, ln_err.data());
    // The residual add: one float add per element.
    for (int64_t i = 0; i < N * C; ++i) {
      BoundedSum r;
      r.add(h[i]);
      r.add(m.out[i]);
      h[i] = r.result();
    }
    ref.aux.v += m.aux.v / double(L), ref.aux.e += m.aux.e / double(L);
    ref.z.v += m.z.v / double(L), ref.z.e += m.z.e / double(L);
  }
  const std::vector<Bounded> hf = rmsnorm_bounded(h, P + layout.final_norm, N, C, eps);
  ref.logits.resize(N * V);
  for (int64_t i = 0; i < N; ++i) {
    double mx = -1e300, mn = 1e300, dmax = 0;
    int64_t best = 0;
    for (int64_t v = 0; v < V; ++v) {
      BoundedSum s;
      for (int64_t c = 0; c < C; ++c) s.add(Bounded{P[layout.head + v * C + c]}, hf[i * C + c]);
      const Bounded lv = s.result();
      ref.logits[i * V + v] = lv;
      dmax = std::max(dmax, lv.e), mn = std::min(mn, lv.v);
      if (lv.v > mx) mx = lv.v, best = v;
    }
    double se = 0;
    for (int64_t v = 0; v < V; ++v) se += std::exp(ref.logits[i * V + v].v - mx);
    const double loss = mx + std::log(se) - ref.logits[i * V + labels[i]].v;
    // The kernel's lse: float terms e^(x − m) (the rounded subtraction, then expf) summed and
    // logged in double; |Δ lse| ≤ max Δlogit, and the loss also moves with the label's logit.
    const double term = std::expm1(kUnitF32 * (mx - mn + 2 * dmax)) + gamma_n(kLibmUnits);
    double loss_err = 2 * dmax - std::log1p(-term);
    loss_err += gamma_n(1) * (std::abs(loss) + loss_err);
    ref.ce.v += loss / double(N), ref.ce.e += loss_err / double(N);
    ref.correct += best == labels[i];
  }
  ref.total.v = ref.ce.v + cfg.aux_loss_coef * ref.aux.v + cfg.z_loss_coef * ref.z.v;
  ref.total.e = ref.ce.e + cfg.aux_loss_coef * ref.aux.e + cfg.z_loss_coef * ref.z.e;
  return ref;
}

void inputs_for(int64_t N, const ClassifierConfig& cfg, std::vector<float>& x,
                std::vector<int32_t>& labels) {
  x = random_vector(N * cfg.input_dim, 11 + N);
  for (auto& v : x) v = std::abs(v);  // pixel-like: non-negative
  labels.resize(N);
  for (int64_t i = 0; i < N; ++i) labels[i] = static_cast<int32_t>((i * 3 + 1) % cfg.n_classes);
}

void check_against_reference(const ClassifierConfig& cfg, int64_t N) {
  SCOPED_TRACE(::testing::Message() << router_kind_name(cfg.router) << " K=" << cfg.top_k
                                    << " N=" << N);
  Classifier model(cfg);
  std::vector<float> params = make_params(model, 5);
  std::vector<float> x;
  std::vector<int32_t> labels;
  inputs_for(N, cfg, x, labels);
  MoeStep step;
  step.training = false;
  ClassifierLoss got = model.forward(params.data(), x.data(), labels.data(), N, step);
  Reference ref = reference(cfg, model.layout(), params, x, labels, N, step);
  expect_within(model.logits(), ref.logits.data(), N * cfg.n_classes, "logits");
  expect_within(got.ce, ref.ce, "ce");
  expect_within(got.aux, ref.aux, "aux");
  expect_within(got.z, ref.z, "z");
  expect_within(got.total, ref.total, "total");
  EXPECT_EQ(got.correct, ref.correct);
  EXPECT_EQ(got.n, N);
}

// The fraction of the model's logits outside the bounds of a reference computed with `bug`
// applied to the parameters.
double outside_with_bug(const ClassifierConfig& cfg, int64_t N,
                        const std::function<void(const ClassifierLayout&, float*)>& bug) {
  Classifier model(cfg);
  std::vector<float> params = make_params(model, 5);
  std::vector<float> x;
  std::vector<int32_t> labels;
  inputs_for(N, cfg, x, labels);
  MoeStep step;
  step.training = false;
  model.forward(params.data(), x.data(), labels.data(), N, step);
  bug(model.layout(), params.data());
  Reference ref = reference(cfg, model.layout(), params, x, labels, N, step);
  const int64_t n = N * cfg.n_classes;
  return double(count_outside(model.logits(), ref.logits.data(), n)) / double(n);
}

void check_model_gradients(const ClassifierConfig& cfg, bool training, int64_t N = 9) {
  SCOPED_TRACE(router_kind_name(cfg.router));
  Classifier model(cfg);
  const ClassifierLayout& layout = model.layout();
  std::vector<float> params = make_params(model, 7), grads(layout.size(), 0.0f);
  std::vector<float> x;
  std::vector<int32_t> labels;
  inputs_for(N, cfg, x, labels);
  MoeStep step;
  step.training = training;  // noisy_topk draws its noise from (seed, step, layer): fixed here
  step.seed = 3;
  step.step = 2;
  ClassifierLoss base = model.forward(params.data(), x.data(), labels.data(), N, step);
  ASSERT_TRUE(std::isfinite(base.total));
  EXPECT_GT(base.z, 0.0);
  model.backward(params.data(), grads.data(), 1.0f);
  auto loss = [&] { return model.forward(params.data(), x.data(), labels.data(), N, step).total; };
  std::set<std::string> groups;
  for (const auto& p : layout.params()) {
    if (p.expert > 1) continue;  // experts: two per projection keep the test fast
    check_gradient(params.data() + p.offset, grads.data() + p.offset, p.numel, loss, p.name.c_str(),
                   1e-2, 1e-3, 3e-2, 12);
    std::string g = p.name;
    if (p.expert >= 0)
      g = g.substr(g.rfind('.', g.size() - 8) + 1);  // "w1.weight"
    else if (g.starts_with("model.layers."))
      g = g.substr(g.find('.', 13) + 1);
    groups.insert(g);
  }
  std::set<std::string> want = {"model.input_proj.weight",
                                "model.input_proj.bias",
                                "norm.weight",
                                "block_sparse_moe.gate.weight",
                                "w1.weight",
                                "w3.weight",
                                "w2.weight",
                                "block_sparse_moe.shared_expert.gate_proj.weight",
                                "block_sparse_moe.shared_expert.up_proj.weight",
                                "block_sparse_moe.shared_expert.down_proj.weight",
                                "model.norm.weight",
                                "classifier.weight"};
  if (cfg.router == RouterKind::NoisyTopK) want.insert("block_sparse_moe.noise.weight");
  EXPECT_EQ(groups, want);
}

}  // namespace

TEST(Classifier, ForwardMatchesDoubleReference) {
  for (int64_t N : {1, 7, 33}) {
    ClassifierConfig c = tiny_config();
    c.top_k = 2;
    check_against_reference(c, N);
    c.input_bias = false;
    c.shared_expert_hidden = 0;
    c.n_layers = 1;
    check_against_reference(c, N);
  }
  ClassifierConfig c = tiny_config("sigmoid_bias");
  c.top_k = 1;
  check_against_reference(c, 10);
  c = tiny_config("expert_choice");
  c.top_k = 2;
  check_against_reference(c, 12);
  c = tiny_config("topk_softmax");
  c.top_k = 2;
  c.capacity_factor = 0.5;  // drops assignments
  check_against_reference(c, 16);
  // Dense products large enough for the blocked oneDNN path, with a partial last block.
  c = wide_config();
  check_against_reference(c, 40);
}

// The bounds compound over the layers but stay far below what a wiring bug moves: with one put
// into the reference, the correct model's logits fall outside them in many places.
TEST(Classifier, ReferenceBoundsCatchABugInTheReference) {
  const ClassifierConfig wide = wide_config();
  const int64_t C = wide.dim, F = wide.expert_hidden;
  EXPECT_EQ(outside_with_bug(wide, 40, [](const ClassifierLayout&, float*) {}), 0.0);
  EXPECT_GT(outside_with_bug(wide, 40,
                             [&](const ClassifierLayout& l, float* p) {
                               std::fill(p + l.input_bias, p + l.input_bias + C, 0.0f);
                             }),
            0.2);
  EXPECT_GT(outside_with_bug(wide, 40,
                             [&](const ClassifierLayout& l, float* p) {
                               std::fill(p + l.final_norm, p + l.final_norm + C, 1.0f);
                             }),
            0.4);
  EXPECT_GT(outside_with_bug(wide, 40,
                             [&](const ClassifierLayout& l, float* p) {
                               for (int64_t r = 0; r < wide.n_experts * F; ++r)
                                 p[l.blocks[0].w1 + r * C + C - 1] = 0.0f;
                             }),
            0.3);
  EXPECT_GT(outside_with_bug(wide, 40,
                             [&](const ClassifierLayout& l, float* p) {
                               for (int64_t v = 0; v < wide.n_classes; ++v)
                                 p[l.head + v * C + C - 1] = 0.0f;
                             }),
            0.5);
  // Through two layers: the first layer's experts 0 and 1 exchanged.
  ClassifierConfig deep = tiny_config();
  deep.top_k = 2;
  const int64_t block = deep.dim * deep.expert_hidden;
  EXPECT_GT(outside_with_bug(deep, 33,
                             [&](const ClassifierLayout& l, float* p) {
                               for (int64_t o : {l.blocks[0].w1, l.blocks[0].w3, l.blocks[0].w2})
                                 std::swap_ranges(p + o, p + o + block, p + o + block);
                             }),
            0.4);
}

TEST(Classifier, GradientsOfEveryParameterGroup) {
  check_model_gradients(tiny_config(), false);
}

TEST(Classifier, GradientsOfEveryRouter) {
  check_model_gradients(tiny_config("noisy_topk"), true);
  check_model_gradients(tiny_config("sigmoid_bias"), false);
  ClassifierConfig ec = tiny_config("expert_choice");
  ec.capacity_factor = 1.0;  // with K = E every expert takes every token: smooth
  check_model_gradients(ec, false);
}

TEST(Classifier, GradientsThroughTheBlockedDenseProducts) {
  check_model_gradients(wide_config(), false, 40);
}

TEST(Classifier, LossWeightScalesEveryGradient) {
  ClassifierConfig cfg = tiny_config();
  cfg.top_k = 2;
  Classifier model(cfg);
  std::vector<float> params = make_params(model, 9);
  std::vector<float> x;
  std::vector<int32_t> labels;
  inputs_for(6, cfg, x, labels);
  MoeStep step;
  std::vector<float> g1(params.size(), 0.0f), g4(params.size(), 0.0f);
  model.forward(params.data(), x.data(), labels.data(), 6, step);
  model.backward(params.data(), g1.data(), 1.0f);
  model.forward(params.data(), x.data(), labels.data(), 6, step);
  model.backward(params.data(), g4.data(), 0.25f);
  for (size_t i = 0; i < g1.size(); ++i)
    ASSERT_NEAR(g4[i], 0.25f * g1[i], 1e-6f + 1e-5f * std::abs(g1[i])) << i;
  // Parameter gradients accumulate: a second backward adds the same again.
  std::vector<float> twice = g1;
  model.forward(params.data(), x.data(), labels.data(), 6, step);
  model.backward(params.data(), twice.data(), 1.0f);
  for (size_t i = 0; i < g1.size(); ++i)
    ASSERT_NEAR(twice[i], 2 * g1[i], 1e-6f + 1e-5f * std::abs(g1[i])) << i;
}

TEST(Classifier, SameResultForAnyThreadCount) {
  ClassifierConfig cfg = tiny_config();
  cfg.top_k = 2;
  cfg.dim = 64;
  cfg.expert_hidden = 96;
  cfg.input_dim = 200;
  Classifier model(cfg);
  std::vector<float> params = make_params(model, 4);
  std::vector<float> x;
  std::vector<int32_t> labels;
  inputs_for(257, cfg, x, labels);
  auto run = [&](int threads) {
    int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> g(params.size(), 0.0f);
    MoeStep step;
    ClassifierLoss l = model.forward(params.data(), x.data(), labels.data(), 257, step);
    model.backward(params.data(), g.data(), 1.0f);
    omp_set_num_threads(saved);
    g.push_back(static_cast<float>(l.total));
    return g;
  };
  std::vector<float> one = run(1), two = run(2), three = run(3);
  for (const auto& p : model.layout().params())
    if (std::memcmp(one.data() + p.offset, two.data() + p.offset, p.numel * sizeof(float)))
      ADD_FAILURE() << "gradient of " << p.name << " differs between 1 and 2 threads";
  EXPECT_EQ(0, std::memcmp(one.data(), two.data(), one.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(one.data(), three.data(), one.size() * sizeof(float)));
}

TEST(Classifier, LayoutNamesAndShapes) {
  ClassifierConfig c = tiny_config("noisy_topk");
  ClassifierLayout layout(c);
  EXPECT_EQ(layout.find("model.input_proj.weight").shape, (Shape{16, 13}));
  EXPECT_EQ(layout.find("model.input_proj.bias").shape, (Shape{16}));
  EXPECT_EQ(layout.find("model.layers.1.norm.weight").shape, (Shape{16}));
  EXPECT_EQ(layout.find("model.layers.0.block_sparse_moe.gate.weight").shape, (Shape{4, 16}));
  EXPECT_EQ(layout.find("model.layers.0.block_sparse_moe.noise.weight").shape, (Shape{4, 16}));
  EXPECT_EQ(layout.find("model.layers.1.block_sparse_moe.experts.3.w2.weight").shape,
            (Shape{16, 12}));
  EXPECT_EQ(layout.find("model.layers.1.block_sparse_moe.shared_expert.up_proj.weight").shape,
            (Shape{8, 16}));
  EXPECT_EQ(layout.find("model.norm.weight").shape, (Shape{16}));
  EXPECT_EQ(layout.find("classifier.weight").shape, (Shape{5, 16}));
  EXPECT_FALSE(layout.find("model.input_proj.bias").decay);
  EXPECT_FALSE(layout.find("model.layers.0.block_sparse_moe.gate.weight").decay);
  EXPECT_TRUE(layout.find("classifier.weight").decay);
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const auto& p : layout.params()) {
    EXPECT_EQ(p.offset % 16, 0) << p.name;
    spans.push_back({p.offset, p.offset + p.numel});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first);
  EXPECT_LE(spans.back().second, layout.size());
  c.input_bias = false;
  c.router = RouterKind::TopKSoftmax;
  ClassifierLayout plain(c);
  EXPECT_EQ(plain.input_bias, -1);
  EXPECT_EQ(plain.find_or_null("model.input_proj.bias"), nullptr);
  EXPECT_EQ(plain.find_or_null("model.layers.0.block_sparse_moe.noise.weight"), nullptr);
}

TEST(Classifier, BadInputIsAClearError) {
  ClassifierConfig cfg = tiny_config();
  Classifier model(cfg);
  std::vector<float> params = make_params(model, 1);
  std::vector<float> x;
  std::vector<int32_t> labels;
  inputs_for(4, cfg, x, labels);
  MoeStep step;
  EXPECT_THROW(model.forward(params.data(), x.data(), labels.data(), 0, step), Error);
  labels[2] = 5;
  try {
    model.forward(params.data(), x.data(), labels.data(), 4, step);
    FAIL() << "label 5 of 5 classes accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("label 5 of row 2"), std::string::npos) << e.what();
  }
  Classifier fresh(cfg);
  std::vector<float> g(params.size());
  EXPECT_THROW(fresh.backward(params.data(), g.data(), 1.0f), Error);  // no forward yet
  fresh.forward(params.data(), x.data(), nullptr, 4, step);            // logits only
  EXPECT_THROW(fresh.backward(params.data(), g.data(), 1.0f), Error);

  auto expect_key = [](ClassifierConfig c, const std::string& key) {
    try {
      c.validate();
      FAIL() << "accepted " << key;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  };
  ClassifierConfig c = tiny_config();
  c.top_k = 5;
  expect_key(c, "model.top_k = 5");
  c = tiny_config();
  c.n_classes = 1;
  expect_key(c, "model.n_classes");
  try {
    parse_router_setting("switch");  // where the configuration is read
    FAIL() << "accepted model.router = switch";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.router = 'switch'"), std::string::npos) << e.what();
  }
  c = tiny_config();
  c.dim = 0;
  expect_key(c, "model.dim = 0");
}
