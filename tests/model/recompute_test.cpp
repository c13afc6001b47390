// Activation recomputation (train.recompute): forward and backward under moe and full give the
// gradients, losses and logits of none, bit for bit, over several steps, in f32 and bf16, with
// dense blocks, shared experts and every router kind; the model holds the activation bytes
// activation_bytes_for predicts, and full holds about 1/L of the blocks' activations.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "model/params.h"
#include "model/transformer.h"
#include "support/small_models.h"

using namespace moetrain;

namespace {

ModelConfig base_config() {
  ModelConfig c = moetrain::testing::small_lm(40, 32, 24, 2);
  c.n_layers = 3;
  c.shared_expert_hidden = 16;
  c.dense_every = 3;  // layer 2 dense
  c.max_seq_len = 64;
  return c;
}

struct Run {
  std::vector<LossParts> losses;
  std::vector<std::vector<float>> grads;  // per step
  std::vector<std::vector<float>> logits;
  std::vector<int64_t> tokens_per_expert;  // the first MoE layer's, last step
  std::vector<float> bias;                 // the first MoE layer's router bias after the steps
};

// Three forward+backward steps on the same parameters with changing batches; sigmoid_bias moves
// its bias between steps, as a trainer does.
Run run(const ModelConfig& cfg, Recompute r, DType lp, int64_t B = 2, int64_t T = 12) {
  Transformer model(cfg);
  model.set_precision(lp);
  model.set_recompute(r);
  std::vector<float> params(static_cast<std::size_t>(model.layout().size()));
  init_params(params.data(), model.layout(), cfg, 7);
  Run out;
  std::vector<int32_t> inputs(B * T), targets(B * T);
  for (int s = 0; s < 3; ++s) {
    for (int64_t i = 0; i < B * T; ++i) {
      inputs[i] = static_cast<int32_t>((i * 7 + 3 + 5 * s) % cfg.vocab_size);
      targets[i] = static_cast<int32_t>((i * 11 + 5 + s) % cfg.vocab_size);
    }
    targets[1] = -1;
    MoeStep step;
    step.seed = 99;
    step.step = static_cast<uint64_t>(s + 1);
    out.losses.push_back(model.forward(params.data(), inputs.data(), targets.data(), B, T, step));
    out.logits.emplace_back(model.logits(), model.logits() + B * T * cfg.vocab_size);
    std::vector<float> g(params.size(), 0.0f);
    model.backward(params.data(), g.data(), 1.0f);
    out.grads.push_back(std::move(g));
    for (MoeLayer* m : model.moe_layers())
      if (cfg.router == RouterKind::SigmoidBias) m->apply_bias_update();
  }
  const MoeLayer& m0 = *model.moe_layers().front();
  out.tokens_per_expert = m0.stats().tokens_per_expert;
  out.bias.assign(m0.router_bias(), m0.router_bias() + cfg.n_experts);
  return out;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

void expect_identical(const ModelConfig& cfg, DType lp, const std::string& what) {
  const Run none = run(cfg, Recompute::None, lp);
  for (Recompute r : {Recompute::Moe, Recompute::Full}) {
    SCOPED_TRACE(what + ", recompute = " + recompute_name(r));
    const Run got = run(cfg, r, lp);
    for (std::size_t s = 0; s < none.grads.size(); ++s) {
      EXPECT_EQ(std::memcmp(&got.losses[s].total, &none.losses[s].total, sizeof(double)), 0);
      EXPECT_EQ(got.losses[s].aux, none.losses[s].aux);
      EXPECT_EQ(got.losses[s].z, none.losses[s].z);
      EXPECT_TRUE(same_bits(got.logits[s], none.logits[s])) << "step " << s;
      EXPECT_TRUE(same_bits(got.grads[s], none.grads[s])) << "gradients of step " << s;
    }
    EXPECT_EQ(got.tokens_per_expert, none.tokens_per_expert);
    EXPECT_TRUE(same_bits(got.bias, none.bias));
  }
  // The test can fail: a gradient from another batch differs.
  EXPECT_FALSE(same_bits(none.grads[0], none.grads[1]));
}

TEST(Recompute, SameBitsF32AndBf16DenseAndShared) {
  expect_identical(base_config(), DType::F32, "f32");
  expect_identical(base_config(), DType::BF16, "bf16");
}

TEST(Recompute, SameBitsEveryRouter) {
  for (RouterKind k : {RouterKind::TopKSoftmax, RouterKind::NoisyTopK, RouterKind::ExpertChoice,
                       RouterKind::SigmoidBias}) {
    ModelConfig c = base_config();
    c.router = k;
    if (k == RouterKind::ExpertChoice) c.capacity_factor = 1.0;
    expect_identical(c, DType::F32, std::string(router_kind_name(k)));
  }
}

TEST(Recompute, SameBitsCapacityDropRerouteAndAgreed) {
  ModelConfig c = base_config();
  c.capacity_factor = 0.6;  // drops
  expect_identical(c, DType::F32, "drop");
  c.overflow = Overflow::Reroute;
  expect_identical(c, DType::BF16, "reroute");
  c.overflow = Overflow::Drop;
  c.capacity_factor = -0.8;  // min(bound, needed)
  expect_identical(c, DType::F32, "capacity < 0");
  c.capacity_factor = 0.0;
  c.route_groups = 2, c.route_group_topk = 1, c.top_k = 2;  // group-limited
  expect_identical(c, DType::F32, "group-limited");
}

TEST(Recompute, CapacityDropsReallyHappen) {
  // The capacity configuration above is not vacuous: the router's choices are dropped.
  ModelConfig c = base_config();
  c.capacity_factor = 0.6;
  Transformer model(c);
  model.set_recompute(Recompute::Full);
  std::vector<float> params(static_cast<std::size_t>(model.layout().size()));
  init_params(params.data(), model.layout(), c, 7);
  std::vector<int32_t> in(24), tg(24);
  for (int i = 0; i < 24; ++i) in[i] = i % 40, tg[i] = (i + 1) % 40;
  model.forward(params.data(), in.data(), tg.data(), 2, 12, MoeStep{});
  EXPECT_GT(model.moe_layers().front()->stats().dropped, 0);
}

// Bytes held after the first forward, before any backward.
int64_t held_after_forward(const ModelConfig& cfg, Recompute r, DType lp, int64_t B, int64_t T) {
  Transformer model(cfg);
  model.set_precision(lp);
  model.set_recompute(r);
  std::vector<float> params(static_cast<std::size_t>(model.layout().size()));
  init_params(params.data(), model.layout(), cfg, 7);
  std::vector<int32_t> in(B * T), tg(B * T);
  for (int64_t i = 0; i < B * T; ++i) in[i] = i % cfg.vocab_size, tg[i] = (i + 1) % cfg.vocab_size;
  model.forward(params.data(), in.data(), tg.data(), B, T, MoeStep{});
  return model.activation_bytes();
}

TEST(Recompute, ActivationBytesShrinkAsPredicted) {
  ModelConfig c = base_config();
  c.n_layers = 8;
  c.dense_every = 0;
  c.top_k = 4;
  c.shared_expert_hidden = 0;
  const int64_t B = 2, T = 32;
  for (DType lp : {DType::F32, DType::BF16}) {
    int64_t held[3];
    for (Recompute r : {Recompute::None, Recompute::Moe, Recompute::Full}) {
      const int64_t got = held_after_forward(c, r, lp, B, T);
      const int64_t want = activation_bytes_for(c, B, T, r, lp);
      SCOPED_TRACE(recompute_name(r));
      // Dropless top-4 over 4 experts routes every token to every expert: N·K rows exactly. What
      // the estimate leaves out: the router's backward scratch, nothing else yet.
      EXPECT_NEAR(static_cast<double>(got), static_cast<double>(want), 0.02 * want);
      held[static_cast<int>(r)] = got;
    }
    EXPECT_LT(held[1], held[0]);
    EXPECT_LT(held[2], held[1]);
    // none − full, measured = predicted: (L − 1) blocks' activations and every MoE layer's rows
    // and intermediates; full keeps one block's activations for L blocks.
    EXPECT_EQ(held[0] - held[2], activation_bytes_for(c, B, T, Recompute::None, lp) -
                                     activation_bytes_for(c, B, T, Recompute::Full, lp));
  }
  // The factor at a shape where activations dominate (T = 64, 8 layers, top-4): full below a
  // third of none.
  const int64_t none = held_after_forward(c, Recompute::None, DType::F32, 2, 64);
  const int64_t moe = held_after_forward(c, Recompute::Moe, DType::F32, 2, 64);
  const int64_t full = held_after_forward(c, Recompute::Full, DType::F32, 2, 64);
  EXPECT_LT(3 * full, none);
  std::printf("activation bytes (8 layers, top-4 of 4, B 2, T 64, f32): none %lld, moe %lld, "
              "full %lld\n",
              static_cast<long long>(none), static_cast<long long>(moe),
              static_cast<long long>(full));
}

TEST(Recompute, PrefillUnderFullFillsEveryLayer) {
  const ModelConfig c = base_config();
  Transformer none(c), full(c);
  full.set_recompute(Recompute::Full);
  std::vector<float> params(static_cast<std::size_t>(none.layout().size()));
  init_params(params.data(), none.layout(), c, 3);
  std::vector<int32_t> tokens = {1, 5, 9, 2, 7, 3};
  KvCache a = none.make_kv_cache(16), b = full.make_kv_cache(16);
  const float* la = none.prefill(params.data(), tokens.data(), 6, a);
  std::vector<float> logits_a(la, la + c.vocab_size);
  const float* lb = full.prefill(params.data(), tokens.data(), 6, b);
  EXPECT_EQ(std::memcmp(logits_a.data(), lb, c.vocab_size * sizeof(float)), 0);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    EXPECT_TRUE(same_bits(a.k[l], b.k[l])) << "layer " << l;
    EXPECT_TRUE(same_bits(a.v[l], b.v[l])) << "layer " << l;
  }
}

}  // namespace
