// An optimizer step keeps the model's low-precision weight copy (core/dtype.h LowPrecisionCopy):
// every element it updates is written there rounded, in its own pass (AdamW) or after it (the
// others); skipped elements are not touched. Checked against rounding the stepped parameters.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "model/config.h"
#include "model/params.h"
#include "model/transformer.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "optim/sharded_optimizer.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

constexpr uint16_t kSentinel = 0x7bcd;

// The stepped parameters rounded to t, for the elements [lo, hi); the sentinel elsewhere.
std::vector<uint16_t> expected_copy(DType t, const std::vector<float>& params, int64_t lo,
                                    int64_t hi) {
  std::vector<uint16_t> out(params.size(), kSentinel);
  f32_to_dtype(t, out.data() + lo, params.data() + lo, static_cast<std::size_t>(hi - lo));
  return out;
}

}  // namespace

TEST(LowPrecisionCopy, EveryOptimizerWritesTheElementsItUpdates) {
  const int64_t n = 70000;  // over the optimizers' parallel threshold
  const std::vector<ParamRange> groups = {{0, 30000, true}, {30000, n - 30000, false}};
  for (OptimizerKind kind :
       {OptimizerKind::AdamW, OptimizerKind::Sgd, OptimizerKind::AdaGrad, OptimizerKind::RmsProp}) {
    for (DType t : {DType::BF16, DType::F16}) {
      OptimizerConfig c = default_optimizer_config(kind);
      c.weight_decay = 0.1;
      auto with = make_optimizer(c, groups, 0, n);
      auto without = make_optimizer(c, groups, 0, n);
      std::vector<float> p1 = random_vector(n, 1), p2 = p1;
      std::vector<uint16_t> copy(n, kSentinel);
      const std::vector<FrozenRange> frozen = {{1000, 500}};
      for (int step = 0; step < 3; ++step) {
        const std::vector<float> g = random_vector(n, 10 + step);
        with->step(p1.data(), g.data(), 1e-2f, frozen, {t, copy.data()});
        without->step(p2.data(), g.data(), 1e-2f, frozen);
      }
      // Writing the copy changes nothing else.
      ASSERT_EQ(0, std::memcmp(p1.data(), p2.data(), n * sizeof(float)))
          << optimizer_kind_name(kind);
      std::vector<uint16_t> want = expected_copy(t, p1, 0, n);
      for (int64_t i = 1000; i < 1500; ++i) want[i] = kSentinel;  // frozen: never written
      EXPECT_EQ(copy, want) << optimizer_kind_name(kind) << " " << dtype_name(t);
    }
  }
}

TEST(LowPrecisionCopy, ShardedPiecesWriteTheirOwnRanges) {
  const int64_t n = 5000;
  const std::vector<ParamRange> groups = {{0, n, true}};
  ShardedOptimizer opt(default_optimizer_config(OptimizerKind::AdamW), groups,
                       {{100, 900}, {3000, 1000}});
  std::vector<float> p = random_vector(n, 3);
  const std::vector<float> g = random_vector(n, 4);
  std::vector<uint16_t> copy(n, kSentinel);
  opt.step(p.data(), g.data(), 1e-2f, {}, {DType::BF16, copy.data()});
  std::vector<uint16_t> want = expected_copy(DType::BF16, p, 0, n);
  for (int64_t i = 0; i < n; ++i)
    if (!((i >= 100 && i < 1000) || (i >= 3000 && i < 4000))) want[i] = kSentinel;
  EXPECT_EQ(copy, want);
}

TEST(LowPrecisionCopy, RejectsAnF32Copy) {
  const std::vector<ParamRange> groups = {{0, 8, true}};
  auto opt = make_optimizer(default_optimizer_config(OptimizerKind::AdamW), groups, 0, 8);
  std::vector<float> p(8, 1.0f), g(8, 1.0f), copy(8);
  EXPECT_THROW(opt->step(p.data(), g.data(), 1e-2f, {}, {DType::F32, copy.data()}), Error);
}

// A bf16 model whose copy the optimizer kept computes the next step's loss with the same bits as
// one that rebuilds its copy from the parameters.
TEST(LowPrecisionCopy, AModelStepsOnTheKeptCopyAsOnARebuiltOne) {
  ModelConfig cfg;
  cfg.vocab_size = 64, cfg.dim = 32, cfg.n_layers = 2, cfg.n_heads = 4, cfg.n_kv_heads = 2;
  cfg.n_experts = 4, cfg.top_k = 2, cfg.expert_hidden = 48, cfg.max_seq_len = 16;
  Transformer kept(cfg), rebuilt(cfg);
  kept.set_precision(DType::BF16);
  rebuilt.set_precision(DType::BF16);
  const ParamLayout& layout = kept.layout();
  std::vector<float> p1(layout.size()), g1(layout.size()), p2, g2(layout.size());
  init_params(p1.data(), layout, cfg, 7);
  p2 = p1;
  const std::vector<ParamRange> groups = param_groups(layout);
  auto o1 =
      make_optimizer(default_optimizer_config(OptimizerKind::AdamW), groups, 0, layout.size());
  auto o2 =
      make_optimizer(default_optimizer_config(OptimizerKind::AdamW), groups, 0, layout.size());
  const int64_t B = 2, T = 8;
  std::vector<int32_t> in(B * T), tg(B * T);
  for (int64_t i = 0; i < B * T; ++i) in[i] = (i * 7) % 64, tg[i] = (i * 11 + 3) % 64;
  MoeStep ms;
  for (int step = 0; step < 3; ++step) {
    std::fill(g1.begin(), g1.end(), 0.0f);
    std::fill(g2.begin(), g2.end(), 0.0f);
    const double l1 = kept.forward(p1.data(), in.data(), tg.data(), B, T, ms).total;
    const double l2 = rebuilt.forward(p2.data(), in.data(), tg.data(), B, T, ms).total;
    ASSERT_EQ(l1, l2) << "step " << step;
    kept.backward(p1.data(), g1.data(), 1.0f);
    rebuilt.backward(p2.data(), g2.data(), 1.0f);
    const LowPrecisionCopy copy = kept.lp_copy_of(p1.data());
    ASSERT_NE(copy.data, nullptr);
    o1->step(p1.data(), g1.data(), 1e-2f, {}, copy);
    kept.weights_changed_copy_kept();
    o2->step(p2.data(), g2.data(), 1e-2f);
    rebuilt.weights_changed();
    EXPECT_EQ(rebuilt.lp_copy_of(p2.data()).data, nullptr);  // stale until the next forward
    ++ms.step;
  }
}
