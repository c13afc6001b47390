// The MoE classifier: the forward against a naive double-precision model, every parameter group's
// gradient by finite differences (every router), layout names, bad input.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <vector>

#include "core/check.h"
#include "model/classifier.h"
#include "moe/moe_reference.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

ClassifierConfig tiny_config(const std::string& router = "topk_softmax") {
  ClassifierConfig c;
  c.input_dim = 13;
  c.n_classes = 5;
  c.dim = 16;
  c.n_layers = 2;
  c.expert_hidden = 12;
  c.n_experts = 4;
  c.top_k = 4;  // every expert: routing is smooth, so finite differences are meaningful everywhere
  c.router = router;
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
  std::vector<double> logits;  // (N, V)
  double ce = 0, aux = 0, z = 0, total = 0;
  int64_t correct = 0;
};

// The whole classifier in double, token by token; the MoE layers through moe_reference.h (which
// takes its input as float, so the normalised stream is rounded once per layer).
Reference reference(const ClassifierConfig& cfg, const ClassifierLayout& layout,
                    std::vector<float>& params, const std::vector<float>& x,
                    const std::vector<int32_t>& labels, int64_t N, const MoeStep& step) {
  const int64_t C = cfg.dim, D = cfg.input_dim, V = cfg.n_classes, L = cfg.n_layers;
  const double eps = cfg.norm_eps;
  const float* P = params.data();
  auto rmsnorm = [&](const std::vector<double>& in, const float* w) {
    std::vector<double> out(N * C);
    for (int64_t i = 0; i < N; ++i) {
      double ss = 0;
      for (int64_t c = 0; c < C; ++c) ss += in[i * C + c] * in[i * C + c];
      double r = 1.0 / std::sqrt(ss / double(C) + eps);
      for (int64_t c = 0; c < C; ++c) out[i * C + c] = double(w[c]) * in[i * C + c] * r;
    }
    return out;
  };
  std::vector<double> h(N * C, 0.0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) {
      double s = layout.input_bias >= 0 ? double(P[layout.input_bias + c]) : 0.0;
      for (int64_t d = 0; d < D; ++d) s += double(P[layout.input_proj + c * D + d]) * x[i * D + d];
      h[i * C + c] = s;
    }
  Reference ref;
  std::vector<float> bias(cfg.n_experts, 0.0f);
  for (int64_t l = 0; l < L; ++l) {
    std::vector<double> ln = rmsnorm(h, P + layout.blocks[l].norm);
    std::vector<float> lnf(ln.begin(), ln.end());
    MoeStep s = step;
    s.layer = static_cast<uint64_t>(l);
    MoeReference m = moe_reference(cfg.moe(), lnf.data(), N, views(params.data(), layout.blocks[l]),
                                   bias.data(), s);
    for (int64_t i = 0; i < N * C; ++i) h[i] += m.out[i];
    ref.aux += m.aux / double(L), ref.z += m.z / double(L);
  }
  std::vector<double> hf = rmsnorm(h, P + layout.final_norm);
  ref.logits.assign(N * V, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    double mx = -1e300;
    int64_t best = 0;
    for (int64_t v = 0; v < V; ++v) {
      double s = 0;
      for (int64_t c = 0; c < C; ++c) s += double(P[layout.head + v * C + c]) * hf[i * C + c];
      ref.logits[i * V + v] = s;
      if (s > mx) mx = s, best = v;
    }
    double se = 0;
    for (int64_t v = 0; v < V; ++v) se += std::exp(ref.logits[i * V + v] - mx);
    ref.ce += (mx + std::log(se) - ref.logits[i * V + labels[i]]) / double(N);
    ref.correct += best == labels[i];
  }
  ref.total = ref.ce + cfg.aux_loss_coef * ref.aux + cfg.z_loss_coef * ref.z;
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
  SCOPED_TRACE(::testing::Message() << cfg.router << " K=" << cfg.top_k << " N=" << N);
  Classifier model(cfg);
  std::vector<float> params = make_params(model, 5);
  std::vector<float> x;
  std::vector<int32_t> labels;
  inputs_for(N, cfg, x, labels);
  MoeStep step;
  step.training = false;
  ClassifierLoss got = model.forward(params.data(), x.data(), labels.data(), N, step);
  Reference ref = reference(cfg, model.layout(), params, x, labels, N, step);
  expect_close(model.logits(), ref.logits.data(), N * cfg.n_classes, 1e-4, 1e-4, "logits");
  EXPECT_NEAR(got.ce, ref.ce, 1e-4 * (1 + ref.ce));
  EXPECT_NEAR(got.aux, ref.aux, 1e-5 * (1 + ref.aux));
  EXPECT_NEAR(got.z, ref.z, 1e-4 * (1 + ref.z));
  EXPECT_NEAR(got.total, ref.total, 1e-4 * (1 + ref.total));
  EXPECT_EQ(got.correct, ref.correct);
  EXPECT_EQ(got.n, N);
}

void check_model_gradients(const ClassifierConfig& cfg, bool training, int64_t N = 9) {
  SCOPED_TRACE(cfg.router);
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
  if (cfg.router == "noisy_topk") want.insert("block_sparse_moe.noise.weight");
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
  c.router = "topk_softmax";
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
  c = tiny_config();
  c.router = "switch";
  expect_key(c, "model.router = 'switch'");
  c = tiny_config();
  c.dim = 0;
  expect_key(c, "model.dim = 0");
}
