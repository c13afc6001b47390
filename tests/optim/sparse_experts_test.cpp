// The sparse-expert mask (optim/sparse_experts.h): keys of the layout's expert tensors, the
// micro-batch threshold of grad.min_accum_fraction, and the ranges the optimizer leaves alone.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/comm.h"
#include "model/params.h"
#include "optim/optimizer.h"
#include "optim/sparse_experts.h"
#include "support/small_models.h"

using namespace moetrain;
using namespace moetrain::testing;

TEST(SparseExperts, EveryExpertTensorHasItsLayerAndExpertKey) {
  const ParamLayout layout(small_lm(64, 16, 8, 2));  // 2 MoE layers of 4 experts
  const std::vector<ExpertPiece> pieces = expert_pieces(layout);
  ASSERT_EQ(pieces.size(), 2u * 4u * 3u);  // w1, w3, w2 of each
  std::vector<int> seen(8, 0);
  for (const ExpertPiece& p : pieces) {
    ASSERT_GE(p.key, 0);
    ASSERT_LT(p.key, 8);
    ++seen[p.key];
  }
  for (int k = 0; k < 8; ++k) EXPECT_EQ(seen[k], 3) << "key " << k;
  // The second layer's experts lie after the first's.
  EXPECT_LT(pieces.front().offset, pieces.back().offset);
  EXPECT_EQ(pieces.front().key / 4, 0);
  EXPECT_EQ(pieces.back().key / 4, 1);
}

TEST(SparseExperts, MinAccumFractionMasksAnExpertTouchedInOneOfFourMicroBatches) {
  EXPECT_EQ(min_touched_micro_batches(4, 0.0), 1);
  EXPECT_EQ(min_touched_micro_batches(4, 0.5), 2);
  EXPECT_EQ(min_touched_micro_batches(10, 0.3), 3);
  EXPECT_EQ(min_touched_micro_batches(4, 1.0), 4);
  // 1 MoE layer of 3 experts, 4 micro-batches: expert 0 in every one, 1 in one, 2 in none.
  const ParamLayout layout([] {
    ModelConfig c = small_lm(64, 16, 8, 1);
    c.n_layers = 1;
    c.n_experts = 3;
    return c;
  }());
  auto comm = make_local_comm();
  for (double p : {0.0, 0.25, 0.5}) {
    SparseExperts sparse(layout, 1, 3, 4, p);
    sparse.start_step();
    for (int64_t a = 0; a < 4; ++a) {
      const int64_t tokens[3] = {5, a == 2 ? 1 : 0, 0};
      sparse.record(a, 0, tokens);
    }
    sparse.agree(*comm);
    const auto active = sparse.active();
    ASSERT_EQ(active.size(), 3u);
    EXPECT_EQ(active[0], 1) << "p = " << p;
    EXPECT_EQ(active[1], p <= 0.25 ? 1 : 0) << "p = " << p;
    EXPECT_EQ(active[2], 0) << "p = " << p;
    EXPECT_EQ(sparse.inactive(), p <= 0.25 ? 1 : 2);
    // Expert 2's three tensors (and expert 1's when masked) are frozen, nothing else.
    int64_t frozen = 0;
    for (const FrozenRange& r : sparse.frozen()) frozen += r.size;
    int64_t want = 0;
    for (const ExpertPiece& piece : expert_pieces(layout))
      want += active[piece.key] ? 0 : piece.size;
    EXPECT_EQ(frozen, want);
    std::vector<float> grads(static_cast<std::size_t>(layout.size()), 1.0f);
    sparse.zero_frozen(grads.data());
    int64_t zeros = 0;
    for (float g : grads) zeros += g == 0.0f;
    EXPECT_EQ(zeros, want);
  }
}

TEST(SparseExperts, TheNextStepZeroesEverythingButTheRowsOfExpertsLeftInactive) {
  // 1 MoE layer of 3 experts: expert 1 untouched in step 1. Step 2's zeroing leaves its rows as
  // they are (a -0.0 written there survives; memset zeros would be +0.0) and zeroes the rest.
  const ParamLayout layout([] {
    ModelConfig c = small_lm(64, 16, 8, 1);
    c.n_layers = 1;
    c.n_experts = 3;
    return c;
  }());
  auto comm = make_local_comm();
  SparseExperts sparse(layout, 1, 3, 1, 0.0);
  const int64_t n = layout.size();
  std::vector<float> grads(static_cast<std::size_t>(n), 1.0f);
  sparse.zero_grads(grads.data(), n);  // first step: nothing is known to be zero
  for (float g : grads) ASSERT_EQ(g, 0.0f);
  sparse.start_step();
  const int64_t tokens[3] = {4, 0, 2};
  sparse.record(0, 0, tokens);
  sparse.agree(*comm);
  std::fill(grads.begin(), grads.end(), 1.0f);  // what backward and the reduction left
  sparse.zero_frozen(grads.data());
  std::vector<uint8_t> in_expert1(static_cast<std::size_t>(n), 0);
  for (const ExpertPiece& piece : expert_pieces(layout))
    if (piece.key == 1) std::fill_n(in_expert1.begin() + piece.offset, piece.size, 1);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(grads[i], in_expert1[i] ? 0.0f : 1.0f) << i;
    if (in_expert1[i]) grads[i] = -0.0f;
  }
  sparse.zero_grads(grads.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(grads[i], 0.0f) << i;
    EXPECT_EQ(std::signbit(grads[i]), in_expert1[i] == 1) << i;
  }
}

TEST(SparseExperts, FrozenRangesJoinAdjacentInactivePieces) {
  const ExpertPiece pieces[] = {{0, 10, 0}, {10, 10, 1}, {20, 10, 2}, {30, 10, 0}};
  const uint8_t active[] = {0, 0, 1};
  const std::vector<FrozenRange> r = frozen_ranges(pieces, active);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].offset, 0);
  EXPECT_EQ(r[0].size, 20);
  EXPECT_EQ(r[1].offset, 30);
  EXPECT_EQ(r[1].size, 10);
}

TEST(SparseExperts, FrozenRangesKeepParamsAndStateBitwiseAndTheRestStepsAsUsual) {
  // A frozen range is left exactly as it was (no decay, no state update) by every optimizer,
  // while every other element gets the bits of an unfrozen step.
  const int64_t n = 1000;
  const ParamRange groups[] = {{0, 400, true}, {400, 100, false}, {500, 500, true}};
  std::vector<OptimizerConfig> configs;
  for (const char* name : {"adamw", "sgd", "adagrad", "rmsprop"}) {
    OptimizerConfig c = default_optimizer_config(name);
    c.weight_decay = 0.05;
    if (c.kind == OptimizerKind::RmsProp) c.momentum = 0.5, c.centered = true;
    configs.push_back(c);
  }
  // Overlapping, unsorted, one reaching past the end.
  const FrozenRange cuts[] = {{600, 37}, {100, 50}, {120, 40}, {390, 20}, {990, 100}};
  auto is_frozen = [&](int64_t i) {
    for (const FrozenRange& f : cuts)
      if (i >= f.offset && i < f.offset + f.size) return true;
    return false;
  };
  auto values = [](int64_t count, int seed) {
    std::vector<float> v(static_cast<std::size_t>(count));
    for (int64_t i = 0; i < count; ++i) v[i] = std::sin(0.37f * float(i) + float(seed)) * 0.5f;
    return v;
  };
  for (const OptimizerConfig& c : configs) {
    const std::string kind(optimizer_kind_name(c.kind));
    auto frozen = make_optimizer(c, groups, 0, n), plain = make_optimizer(c, groups, 0, n);
    std::vector<float> fp = values(n, 1), pp = fp;
    for (int s = 0; s < 3; ++s) {
      const auto g = values(n, 10 + s);
      frozen->step(fp.data(), g.data(), 0.01f);
      plain->step(pp.data(), g.data(), 0.01f);
    }
    const std::vector<float> before = fp;
    std::vector<std::vector<float>> state_before;
    for (const StateBuffer& b : frozen->state())
      state_before.emplace_back(b.values.begin(), b.values.end());
    const auto g = values(n, 20);
    frozen->step(fp.data(), g.data(), 0.01f, cuts);
    plain->step(pp.data(), g.data(), 0.01f);
    EXPECT_EQ(frozen->step_count(), 4) << kind;
    int64_t would_move = 0, bad = 0;
    auto fs = frozen->state(), ps = plain->state();
    for (int64_t i = 0; i < n; ++i) {
      const float want = is_frozen(i) ? before[i] : pp[i];
      bad += std::memcmp(&fp[i], &want, sizeof(float)) != 0;
      for (std::size_t b = 0; b < fs.size(); ++b) {
        const float w = is_frozen(i) ? state_before[b][i] : ps[b].values[i];
        bad += std::memcmp(&fs[b].values[i], &w, sizeof(float)) != 0;
      }
      would_move += is_frozen(i) && pp[i] != before[i];
    }
    EXPECT_EQ(bad, 0) << kind << ": elements differing from the frozen / unfrozen expectation";
    // An unfrozen step would have moved the frozen elements: the test tells the two apart.
    EXPECT_GT(would_move, 0) << kind;
  }
}
