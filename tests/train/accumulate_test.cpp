// The micro-batch accumulation routine against the loop written out by hand: gradients (bit for
// bit), loss means, summed expert loads and dropped fractions, the overlap hook's place, and the
// non-finite loss error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/rng.h"
#include "model/params.h"
#include "support/small_models.h"
#include "train/accumulate.h"

using namespace moetrain;

namespace {

ModelConfig tiny_lm() {
  ModelConfig c = moetrain::testing::small_lm(24, 16, 12, 2);
  c.capacity_factor = 1.0f;  // some tokens dropped: the dropped fractions are not all zero
  c.max_seq_len = 16;
  return c;
}

constexpr int64_t kA = 3, kB = 2, kT = 8;

// Tokens of micro-batch m: inputs then targets, (B, T) each.
std::vector<int32_t> tokens(int64_t m, int64_t V) {
  Rng rng(99, static_cast<uint64_t>(m));
  std::vector<int32_t> t(2 * kB * kT);
  for (std::size_t i = 0; i < t.size(); ++i)
    t[i] = static_cast<int32_t>(rng.below(i, static_cast<uint64_t>(V)));
  return t;
}

MoeStep step_of(int64_t micro) {
  MoeStep ms;
  ms.training = true;
  ms.seed = 5;
  ms.step = static_cast<uint64_t>(micro);
  return ms;
}

}  // namespace

TEST(Accumulate, MatchesTheHandWrittenLoopAndHooksBeforeTheLastBackward) {
  const ModelConfig cfg = tiny_lm();
  Transformer model(cfg);
  const int64_t n = model.layout().size();
  std::vector<float> params(n);
  init_params(params.data(), model.layout(), cfg, 3);
  const float weight = 0.25f;
  const double divisor = 6.0;

  // By hand.
  std::vector<float> ref(n, 0.0f), before_last;
  LossParts sum;
  std::vector<int64_t> load(2 * cfg.n_experts, 0);
  std::vector<double> dropped(2, 0.0);
  for (int64_t m = 0; m < kA; ++m) {
    std::vector<int32_t> t = tokens(m, cfg.vocab_size);
    LossParts p = model.forward(params.data(), t.data(), t.data() + kB * kT, kB, kT, step_of(m));
    if (m == kA - 1) before_last = ref;
    model.backward(params.data(), ref.data(), weight);
    sum.ce += p.ce / kA, sum.aux += p.aux / kA, sum.z += p.z / kA, sum.total += p.total / kA;
    sum.targets += p.targets;
    auto moe = model.moe_layers();
    for (std::size_t l = 0; l < moe.size(); ++l) {
      for (int64_t e = 0; e < cfg.n_experts; ++e)
        load[l * cfg.n_experts + e] += moe[l]->stats().tokens_per_expert[e];
      dropped[l] += moe[l]->stats().fraction_dropped / divisor;
    }
  }

  std::vector<float> grads(n, 123.0f);  // stale values: the routine zeroes them
  std::vector<int32_t> buffer;
  int hooks = 0;
  AccumulateArgs<TokenBatch> args;
  args.micro_batches = kA;
  args.loss_weight = weight;
  args.dropped_divisor = divisor;
  args.fill = [&](int64_t m) {
    buffer = tokens(m, cfg.vocab_size);
    return TokenBatch{buffer.data(), buffer.data() + kB * kT, kB, kT};
  };
  args.moe_step = step_of;
  args.before_last_backward = [&] {
    ++hooks;
    EXPECT_EQ(0, std::memcmp(grads.data(), before_last.data(), n * sizeof(float)))
        << "the hook runs after the other micro-batches' backward, before the last one's";
  };
  args.bad_loss = [](const LossParts&) { return std::string("unused"); };
  Accumulated acc = accumulate(model, params.data(), grads.data(), n, args);

  EXPECT_EQ(hooks, 1);
  EXPECT_EQ(0, std::memcmp(grads.data(), ref.data(), n * sizeof(float)));
  EXPECT_EQ(acc.loss.ce, sum.ce);
  EXPECT_EQ(acc.loss.total, sum.total);
  EXPECT_EQ(acc.loss.targets, sum.targets);
  ASSERT_EQ(acc.tokens_per_expert.size(), 2u);
  for (std::size_t l = 0; l < 2; ++l)
    for (int64_t e = 0; e < cfg.n_experts; ++e)
      EXPECT_EQ(acc.tokens_per_expert[l][e], load[l * cfg.n_experts + e]);
  EXPECT_EQ(acc.dropped, dropped);
  double any_dropped = 0;
  for (double d : dropped) any_dropped += d;
  EXPECT_GT(any_dropped, 0.0);
}

TEST(Accumulate, NonFiniteLossIsAnErrorWithTheCallersText) {
  const ModelConfig cfg = tiny_lm();
  Transformer model(cfg);
  const int64_t n = model.layout().size();
  std::vector<float> params(n, std::numeric_limits<float>::quiet_NaN()), grads(n);
  std::vector<int32_t> t = tokens(0, cfg.vocab_size);
  AccumulateArgs<TokenBatch> args;
  args.fill = [&](int64_t) { return TokenBatch{t.data(), t.data() + kB * kT, kB, kT}; };
  args.moe_step = step_of;
  args.bad_loss = [](const LossParts& p) {
    return "clock 3: the loss is " + std::to_string(p.total);
  };
  try {
    accumulate(model, params.data(), grads.data(), n, args);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("clock 3: the loss is"), std::string::npos) << e.what();
  }
}

TEST(Accumulate, ClassifierCountsCorrectRows) {
  ClassifierConfig c = moetrain::testing::small_classifier(2);
  Classifier model(c);
  const int64_t n = model.layout().size(), N = 6;
  std::vector<float> params(n), grads(n), x(N * c.input_dim);
  init_classifier_params(params.data(), model.layout(), c, 1);
  Rng rng(4, 0);
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(rng.below(i, 100)) / 50.0f - 1.0f;
  std::vector<int32_t> labels = {0, 1, 2, 3, 4, 0};
  ClassifierLoss ref = model.forward(params.data(), x.data(), labels.data(), N, step_of(0));
  AccumulateArgs<ImageBatch> args;
  args.fill = [&](int64_t) { return ImageBatch{x.data(), labels.data(), N}; };
  args.moe_step = step_of;
  args.bad_loss = [](const LossParts&) { return std::string("bad"); };
  Accumulated acc = accumulate(model, params.data(), grads.data(), n, args);
  EXPECT_EQ(acc.correct, ref.correct);
  EXPECT_EQ(acc.loss.targets, N);
  EXPECT_EQ(acc.loss.total, ref.total);
}
