// Sampling within a window with a KV cache: the cached decode path against full recomputation of
// the same windows, the work it does per token, and a long sample's determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "model/params.h"
#include "model/sampler.h"
#include "model/transformer.h"
#include "support/error_bound.h"
#include "support/small_models.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

ModelConfig sampler_config() {
  // top-k = every expert: routing has no discrete choice that a rounding difference could flip,
  // so the two paths differ by float summation order alone.
  ModelConfig c = small_lm(24, 16, 12, 4);
  c.max_seq_len = 16;
  c.init_std = 0.3;
  return c;
}

// Longest chain of f32 sums from the embedding to one logit: per layer the attention norm,
// the q/k/v projections, the scores and the weighted values over at most T keys (HS and T
// terms), the output projection, the FFN norm, the experts' (or dense FFN's) two projections
// and the weighted combine; then the final norm and the LM head.
int64_t reduction_length(const ModelConfig& c, int64_t T) {
  const int64_t C = c.dim, HS = c.head_dim(), QD = c.n_heads * HS;
  const int64_t F = std::max(c.expert_hidden, c.dense_every > 0 ? c.dense_ffn_hidden() : 0) +
                    c.shared_expert_hidden;
  const int64_t per_layer = C + C + HS + T + QD + C + C + F + c.top_k + 1;
  return c.n_layers * per_layer + C + C;
}

void expect_cached_matches_recompute(const ModelConfig& cfg, int64_t T, int64_t n_tokens) {
  Transformer model(cfg);
  std::vector<float> params(model.layout().size());
  init_params(params.data(), model.layout(), cfg, 11);
  std::vector<int32_t> seq(static_cast<std::size_t>(n_tokens));
  for (int64_t i = 0; i < n_tokens; ++i)
    seq[i] = static_cast<int32_t>((i * 7 + i / 5 + 3) % cfg.vocab_size);
  const std::vector<int32_t> prompt(seq.begin(), seq.begin() + 3);
  WindowDecoder cached(model, params.data(), T, true);
  Transformer ref_model(cfg);
  WindowDecoder full(ref_model, params.data(), T, false);
  const int64_t V = cfg.vocab_size;
  // Both paths compute the same expressions and differ only in summation order, so each lies
  // within γ_m (relative, m the longest reduction chain) of the exact value at every stage, and
  // they differ by at most twice that. A logit is the LM head's dot product over the final norm's
  // output y = g ⊙ x/rms(x), with ‖x/rms(x)‖₂ = √C: Σ_c |W_vc||y_c| ≤ max|W|·max|g|·C, and a
  // relative error δ in y moves the logit by at most δ times that sum. The norms and softmaxes in
  // between rescale relative errors by O(1) factors, allowed for by a margin of 8.
  const ParamLayout& lay = model.layout();
  double wmax = 0, gmax = 0;
  for (int64_t i = 0; i < V * cfg.dim; ++i)
    wmax = std::max(wmax, std::abs(double(params[lay.lm_head + i])));
  for (int64_t i = 0; i < cfg.dim; ++i)
    gmax = std::max(gmax, std::abs(double(params[lay.final_norm + i])));
  const double tol = 8.0 * 2.0 * gamma_n(reduction_length(cfg, T)) * wmax * gmax * cfg.dim;
  const float* a = cached.start(prompt);
  std::vector<float> la(a, a + V);
  const float* b = full.start(prompt);
  int64_t checked = 0;
  for (int64_t i = 3;; ++i) {
    for (int64_t v = 0; v < V; ++v)
      ASSERT_NEAR(la[v], b[v], tol) << "token " << i << " logit " << v << " (window start "
                                    << cached.window_start() << ")";
    ++checked;
    if (i == n_tokens) break;
    a = cached.push(seq[i]);
    la.assign(a, a + V);
    b = full.push(seq[i]);
    ASSERT_EQ(cached.window_start(), full.window_start());
  }
  EXPECT_EQ(checked, n_tokens - 2);
  // The cache was refilled only when the window restarted, and decoded every other token.
  EXPECT_LT(cached.recomputes(), full.recomputes());
  EXPECT_GT(cached.recomputes(), 1);
}

}  // namespace

TEST(Sampler, CachedLogitsMatchFullRecomputeAtEveryPosition) {
  expect_cached_matches_recompute(sampler_config(), 8, 60);
}

TEST(Sampler, CachedLogitsMatchWithOddWindowSharedExpertAndDenseLayer) {
  ModelConfig c = sampler_config();
  c.shared_expert_hidden = 8;
  c.dense_every = 2;
  c.dense_hidden = 10;
  expect_cached_matches_recompute(c, 7, 50);
}

TEST(Sampler, WindowRestartsWithItsLastHalf) {
  ModelConfig cfg = sampler_config();
  Transformer model(cfg);
  std::vector<float> params(model.layout().size());
  init_params(params.data(), model.layout(), cfg, 3);
  WindowDecoder dec(model, params.data(), 8);
  dec.start({1, 2, 3, 4, 5, 6, 7, 8});
  EXPECT_EQ(dec.window_start(), 0);
  dec.push(9);  // 9 tokens > 8: the window keeps the last 4
  EXPECT_EQ(dec.window_start(), 5);
  EXPECT_EQ(dec.cache().length, 4);
  dec.push(10);
  EXPECT_EQ(dec.cache().length, 5);
  // A prompt longer than the window starts it with its last half.
  dec.start(std::vector<int32_t>(20, 1));
  EXPECT_EQ(dec.window_start(), 16);
}

TEST(Sampler, ThousandTokensDeterministicPerSeedOverAtMostTKeys) {
  ModelConfig cfg = sampler_config();
  cfg.max_seq_len = 32;  // room beyond the window: the window, not the model's limit, must bind
  Transformer model(cfg);
  std::vector<float> params(model.layout().size());
  init_params(params.data(), model.layout(), cfg, 5);
  const int64_t T = 16, n = 1000;
  SampleOptions opt;
  opt.context = T;
  opt.max_tokens = n;
  opt.temperature = 1.0;
  opt.top_k = 0;
  opt.seed = 42;
  auto run = [&](uint64_t seed, KvCache* work) {
    SampleOptions o = opt;
    o.seed = seed;
    WindowDecoder dec(model, params.data(), T);
    std::vector<int32_t> out = sample_tokens(dec, {1, 2, 3}, o);
    if (work) *work = dec.cache();
    return out;
  };
  KvCache work;
  std::vector<int32_t> a = run(42, &work);
  ASSERT_EQ(static_cast<int64_t>(a.size()), n);
  for (int32_t t : a) ASSERT_TRUE(t >= 0 && t < cfg.vocab_size);
  EXPECT_EQ(run(42, nullptr), a);
  EXPECT_NE(run(43, nullptr), a);
  // Work, not time: no query attended to more than T keys, and the decode steps together read
  // at most T keys per token per layer (quadratic recomputation would read up to n per token).
  EXPECT_LE(work.max_keys, T);
  EXPECT_GT(work.max_keys, T / 2);
  EXPECT_LE(work.keys_attended, n * cfg.n_layers * T);
  EXPECT_GT(work.keys_attended, n * cfg.n_layers * T / 4);
}
