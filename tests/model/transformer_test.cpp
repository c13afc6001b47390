// The whole model: every parameter group's gradient by finite differences, and a tiny model
// overfitting a fixed batch.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "core/check.h"
#include "model/params.h"
#include "model/transformer.h"
#include "optim/optimizer.h"
#include "support/gradcheck.h"
#include "support/small_models.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

ModelConfig tiny_config() {
  // top-k = every expert: routing is smooth, so finite differences are meaningful everywhere.
  ModelConfig c = moetrain::testing::small_lm(24, 16, 12, 4);
  c.max_seq_len = 16;
  c.init_std = 0.3;  // larger weights than training uses: gradients well above float noise
  c.aux_loss_coef = 0.1;
  c.z_loss_coef = 0.05;
  return c;
}

void check_model_gradients(const ModelConfig& cfg) {
  Transformer model(cfg);
  const ParamLayout& layout = model.layout();
  std::vector<float> params(layout.size()), grads(layout.size(), 0.0f);
  init_params(params.data(), layout, cfg, 7);
  // Norm weights away from 1 so their gradients are exercised non-trivially.
  for (const auto& p : layout.params())
    if (p.shape.size() == 1)
      for (int64_t i = 0; i < p.numel; ++i) params[p.offset + i] = 1.0f + 0.1f * std::sin(float(i));
  const int64_t B = 2, T = 6;
  std::vector<int32_t> inputs(B * T), targets(B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    inputs[i] = static_cast<int32_t>((i * 7 + 3) % cfg.vocab_size);
    targets[i] = i % 5 == 4 ? -1 : static_cast<int32_t>((i * 5 + 1) % cfg.vocab_size);
  }
  MoeStep step;
  step.training = false;
  LossParts base = model.forward(params.data(), inputs.data(), targets.data(), B, T, step);
  ASSERT_TRUE(std::isfinite(base.total));
  EXPECT_GT(base.aux, 0.0);
  EXPECT_GT(base.z, 0.0);
  model.backward(params.data(), grads.data(), 1.0f);
  auto loss = [&] {
    return model.forward(params.data(), inputs.data(), targets.data(), B, T, step).total;
  };
  std::set<std::string> groups;
  for (const auto& p : layout.params()) {
    // Every tensor of every kind; experts: a few per projection keep the test fast.
    if (p.expert > 1) continue;
    check_gradient(params.data() + p.offset, grads.data() + p.offset, p.numel, loss, p.name.c_str(),
                   1e-2, 1e-3, 3e-2, 12);
    groups.insert(p.name.substr(p.name.rfind('.', p.name.size() - 8) + 1));
  }
  EXPECT_GE(groups.size(), 8u);
}

}  // namespace

TEST(Transformer, GradientsOfEveryParameterGroup) {
  check_model_gradients(tiny_config());
}

TEST(Transformer, GradientsWithSharedExpertAndDenseLayer) {
  ModelConfig c = tiny_config();
  c.shared_expert_hidden = 8;
  c.dense_every = 2;  // layer 1 dense
  c.dense_hidden = 10;
  check_model_gradients(c);
}

TEST(Transformer, HuggingFaceNamesAndLayout) {
  ModelConfig c = tiny_config();
  ParamLayout layout(c);
  EXPECT_EQ(layout.find("model.embed_tokens.weight").shape, (Shape{24, 16}));
  EXPECT_EQ(layout.find("model.layers.1.self_attn.k_proj.weight").shape, (Shape{8, 16}));
  EXPECT_EQ(layout.find("model.layers.0.block_sparse_moe.gate.weight").shape, (Shape{4, 16}));
  EXPECT_EQ(layout.find("model.layers.0.block_sparse_moe.experts.3.w2.weight").shape,
            (Shape{16, 12}));
  EXPECT_EQ(layout.find("lm_head.weight").shape, (Shape{24, 16}));
  EXPECT_FALSE(layout.find("model.norm.weight").decay);
  // Tensors never overlap and stay inside the buffer.
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const auto& p : layout.params()) spans.push_back({p.offset, p.offset + p.numel});
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first);
  EXPECT_LE(spans.back().second, layout.size());
  EXPECT_THROW(layout.find("model.layers.9.mlp.weight"), Error);
}

TEST(Transformer, ConfigErrorsNameTheKey) {
  ModelConfig c = tiny_config();
  c.n_heads = 3;
  try {
    c.validate();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_heads = 3"), std::string::npos) << e.what();
  }
  c = tiny_config();
  c.top_k = 5;
  EXPECT_THROW(c.validate(), Error);
  // A router name is parsed where the configuration is read: an unknown one never reaches the
  // model.
  EXPECT_THROW(parse_router_setting("bogus"), Error);
}

TEST(Transformer, OverfitsAFixedBatch) {
  ModelConfig c = tiny_config();
  c.top_k = 2;
  c.init_std = 0.02;
  c.dim = 32;
  c.expert_hidden = 32;
  Transformer model(c);
  const ParamLayout& layout = model.layout();
  std::vector<float> params(layout.size()), grads(layout.size());
  init_params(params.data(), layout, c, 3);
  OptimizerConfig oc = default_optimizer_config(OptimizerKind::AdamW);
  oc.weight_decay = 0.0;
  auto opt =
      make_optimizer(oc, std::vector<ParamRange>{{0, layout.size(), false}}, 0, layout.size());
  const int64_t B = 2, T = 16;
  std::vector<int32_t> inputs(B * T), targets(B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    inputs[i] = static_cast<int32_t>((i * 11 + 5) % c.vocab_size);
    targets[i] = static_cast<int32_t>((i * 13 + 2) % c.vocab_size);
  }
  MoeStep step;
  double first = 0, last = 0;
  for (int it = 0; it < 150; ++it) {
    std::fill(grads.begin(), grads.end(), 0.0f);
    step.step = it;
    LossParts p = model.forward(params.data(), inputs.data(), targets.data(), B, T, step);
    if (it == 0) first = p.ce;
    last = p.ce;
    model.backward(params.data(), grads.data(), 1.0f);
    opt->step(params.data(), grads.data(), 1e-2f);
  }
  EXPECT_GT(first, 2.5);
  EXPECT_LT(last, 0.05) << "cross-entropy after 150 steps on one batch";
}

// Asking for the GPU where there is none says why: a build without the CUDA backend, or a machine
// without a usable device (the driver's reason). Skipped where a GPU is usable (tests/cuda).
TEST(Transformer, DeviceCudaWithoutABackendOrAGpuSaysWhy) {
  ModelConfig cfg;
  cfg.dim = 32, cfg.n_layers = 1, cfg.n_heads = 4, cfg.n_kv_heads = 2, cfg.expert_hidden = 32;
  cfg.n_experts = 4, cfg.top_k = 2, cfg.max_seq_len = 16;
  Transformer model(cfg);
  try {
    model.set_device("cuda");
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("train.device = "), std::string::npos) << msg;
    EXPECT_TRUE(msg.find("no CUDA backend") != std::string::npos ||
                msg.find("CUDA device") != std::string::npos)
        << msg;
    EXPECT_EQ(model.device_ops(), nullptr);
    return;
  }
  GTEST_SKIP() << "a GPU is usable here";
}
