// Pipeline stages of the language model (Transformer::set_stage): the stages run one after
// another, each handing its output (forward) and its input's gradient (backward) to the next,
// give the whole model's cross-entropy, logits and gradients bit for bit — in f32 and bf16, with
// dense blocks and shared experts, with full recomputation — and refuse what a stage cannot do.
// Split backward (the zero_bubble schedule's B and W passes) gives backward's gradients bit for
// bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "model/activation_bytes.h"
#include "model/params.h"
#include "model/transformer.h"
#include "support/expect_error.h"
#include "support/small_models.h"

using namespace moetrain;

namespace {

ModelConfig stage_config() {
  ModelConfig c = moetrain::testing::small_lm(40, 32, 24, 2);
  c.n_layers = 4;
  c.shared_expert_hidden = 16;
  c.dense_every = 3;  // layer 2 dense
  c.max_seq_len = 64;
  return c;
}

struct Result {
  LossParts loss;
  std::vector<float> logits, grads;
};

constexpr int64_t kB = 2, kT = 12;

std::pair<std::vector<int32_t>, std::vector<int32_t>> batch(const ModelConfig& cfg, int s) {
  std::vector<int32_t> inputs(kB * kT), targets(kB * kT);
  for (int64_t i = 0; i < kB * kT; ++i) {
    inputs[i] = static_cast<int32_t>((i * 7 + 3 + 5 * s) % cfg.vocab_size);
    targets[i] = static_cast<int32_t>((i * 11 + 5 + s) % cfg.vocab_size);
  }
  targets[1] = -1;
  return {inputs, targets};
}

MoeStep step_of(int s) {
  MoeStep step;
  step.seed = 99;
  step.step = static_cast<uint64_t>(s + 1);
  return step;
}

// Two steps through stages cut at `cuts` (block indices; empty: the whole model), each stage its
// own model object over the one parameter buffer; the parameters move between the steps.
Result run(const ModelConfig& cfg, const std::vector<int64_t>& cuts, DType lp, Recompute r) {
  std::vector<int64_t> bounds = {0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(cfg.n_layers);
  std::vector<std::unique_ptr<Transformer>> stages;
  for (std::size_t s = 0; s + 1 < bounds.size(); ++s) {
    stages.push_back(std::make_unique<Transformer>(cfg));
    stages.back()->set_precision(lp);
    stages.back()->set_recompute(r);
    stages.back()->set_stage(bounds[s], bounds[s + 1]);
  }
  std::vector<float> params(static_cast<std::size_t>(stages[0]->layout().size()));
  init_params(params.data(), stages[0]->layout(), cfg, 7);
  Result out;
  for (int s = 0; s < 2; ++s) {
    const auto [inputs, targets] = batch(cfg, s);
    out.loss = {};
    const float* x = nullptr;
    for (auto& st : stages) {
      const LossParts p =
          st->forward(params.data(), inputs.data(), x, targets.data(), kB, kT, step_of(s));
      out.loss.ce += p.ce, out.loss.aux += p.aux, out.loss.z += p.z, out.loss.total += p.total;
      out.loss.targets += p.targets;
      x = st->last_stage() ? nullptr : st->stage_output();
    }
    out.logits.assign(stages.back()->logits(), stages.back()->logits() + kB * kT * cfg.vocab_size);
    out.grads.assign(params.size(), 0.0f);
    const float* dout = nullptr;
    for (std::size_t k = stages.size(); k-- > 0;) {
      // Each stage writes its own gradient buffer: the stages' ranges do not overlap.
      std::vector<float> g(params.size(), 0.0f);
      stages[k]->backward(params.data(), g.data(), 0.5f, dout);
      for (std::size_t i = 0; i < g.size(); ++i) out.grads[i] += g[i];
      dout = stages[k]->stage_first() > 0 ? stages[k]->stage_input_grad() : nullptr;
    }
    for (std::size_t i = 0; i < params.size(); ++i) params[i] -= 0.05f * out.grads[i];
    for (auto& st : stages) st->weights_changed();
  }
  return out;
}

void expect_same(const Result& whole, const Result& staged) {
  EXPECT_EQ(whole.loss.ce, staged.loss.ce);
  EXPECT_EQ(whole.loss.targets, staged.loss.targets);
  // The balancing losses are summed per stage, then over stages: the same terms, regrouped.
  EXPECT_NEAR(whole.loss.aux, staged.loss.aux, 1e-12 * std::abs(whole.loss.aux) + 1e-15);
  EXPECT_NEAR(whole.loss.z, staged.loss.z, 1e-12 * std::abs(whole.loss.z) + 1e-15);
  EXPECT_GT(whole.loss.aux, 0);
  ASSERT_EQ(whole.logits.size(), staged.logits.size());
  EXPECT_EQ(0, std::memcmp(whole.logits.data(), staged.logits.data(),
                           whole.logits.size() * sizeof(float)));
  ASSERT_EQ(whole.grads.size(), staged.grads.size());
  int64_t differ = 0, nonzero = 0;
  for (std::size_t i = 0; i < whole.grads.size(); ++i) {
    differ += whole.grads[i] != staged.grads[i];
    nonzero += whole.grads[i] != 0.0f;
  }
  EXPECT_EQ(differ, 0) << "of " << whole.grads.size() << " gradients";
  EXPECT_GT(nonzero, static_cast<int64_t>(whole.grads.size()) / 2);
}

TEST(TransformerStage, StagesEqualTheWholeModelBitForBit) {
  const ModelConfig cfg = stage_config();
  for (DType lp : {DType::F32, DType::BF16})
    for (Recompute r : {Recompute::None, Recompute::Full}) {
      const Result whole = run(cfg, {}, lp, r);
      for (const std::vector<int64_t>& cuts :
           std::vector<std::vector<int64_t>>{{1}, {2}, {3}, {1, 3}, {1, 2, 3}}) {
        SCOPED_TRACE(::testing::Message() << "precision " << dtype_name(lp) << " recompute "
                                          << recompute_name(r) << " cuts " << cuts.size()
                                          << " first " << cuts[0]);
        expect_same(whole, run(cfg, cuts, lp, r));
      }
    }
}

TEST(TransformerStage, AStageHoldsItsOwnBlocksActivations) {
  const ModelConfig cfg = stage_config();
  Transformer whole(cfg), first(cfg);
  first.set_stage(0, 1);
  std::vector<float> params(static_cast<std::size_t>(whole.layout().size()));
  init_params(params.data(), whole.layout(), cfg, 7);
  const auto [inputs, targets] = batch(cfg, 0);
  whole.forward(params.data(), inputs.data(), targets.data(), kB, kT, step_of(0));
  first.forward(params.data(), inputs.data(), nullptr, targets.data(), kB, kT, step_of(0));
  // One block of four and no head: well under half of the whole model's.
  EXPECT_LT(first.activation_bytes() * 2, whole.activation_bytes());
}

TEST(TransformerStage, RefusesWhatAStageCannotDo) {
  const ModelConfig cfg = stage_config();
  Transformer later(cfg);
  moetrain::testing::expect_error([&] { later.set_stage(2, 2); }, {"[2, 2)", "model.n_layers = 4"});
  later.set_stage(2, 4);
  std::vector<float> params(static_cast<std::size_t>(later.layout().size()));
  init_params(params.data(), later.layout(), cfg, 7);
  const auto [inputs, targets] = batch(cfg, 0);
  moetrain::testing::expect_error(
      [&] { later.forward(params.data(), inputs.data(), targets.data(), kB, kT, step_of(0)); },
      {"block 2", "previous stage's output"});
  KvCache cache = later.make_kv_cache(8);
  moetrain::testing::expect_error(
      [&] { later.prefill(params.data(), inputs.data(), 4, cache); }, {"pipeline stage"});
  Transformer earlier(cfg);
  earlier.set_stage(0, 2);
  earlier.forward(params.data(), inputs.data(), nullptr, targets.data(), kB, kT, step_of(0));
  std::vector<float> g(params.size(), 0.0f);
  moetrain::testing::expect_error([&] { earlier.backward(params.data(), g.data(), 1.0f); },
                                  {"block 2", "gradient of its output"});
}

// Two micro-batches in two model objects (a pipeline stage's activation slots), as zero_bubble
// runs them — F0 F1 B0 B1 W0 W1, the weight passes after both backwards — against backward
// unsplit (F0 B0 F1 B1): the same gradients bit for bit, each parameter's contributions in
// micro-batch order through the same GEMM calls; the grads-ready hook called from the weight
// passes only, with the same offsets; the deferred output gradients counted as activations.
TEST(TransformerStage, SplitBackwardGivesBackwardsBits) {
  const ModelConfig cfg = stage_config();
  for (DType lp : {DType::F32, DType::BF16})
    for (Recompute r : {Recompute::None, Recompute::Moe}) {
      SCOPED_TRACE(::testing::Message() << "precision " << dtype_name(lp) << " recompute "
                                        << recompute_name(r));
      std::vector<std::unique_ptr<Transformer>> slots;
      std::vector<int64_t> calls;
      for (int k = 0; k < 2; ++k) {
        slots.push_back(std::make_unique<Transformer>(cfg));
        slots.back()->set_precision(lp);
        slots.back()->set_recompute(r);
        slots.back()->set_grads_ready_hook([&calls](int64_t from) { calls.push_back(from); });
      }
      std::vector<float> params(static_cast<std::size_t>(slots[0]->layout().size()));
      init_params(params.data(), slots[0]->layout(), cfg, 7);
      auto forward = [&](int k) {
        const auto [inputs, targets] = batch(cfg, k);
        slots[k]->forward(params.data(), inputs.data(), targets.data(), kB, kT, step_of(k));
      };
      std::vector<float> whole(params.size(), 0.0f), split(params.size(), 0.0f);
      for (int k = 0; k < 2; ++k) {
        forward(k);
        slots[k]->backward(params.data(), whole.data(), 0.5f);
      }
      const std::vector<int64_t> whole_calls = calls;
      calls.clear();
      for (auto& s : slots) s->set_split_backward(true);
      forward(0), forward(1);
      const int64_t held = slots[0]->activation_bytes();
      for (int k = 0; k < 2; ++k) slots[k]->backward(params.data(), split.data(), 0.5f);
      EXPECT_TRUE(calls.empty()) << "a unit's gradients are final only after its weight pass";
      // The head's weight gradient waits for the weight pass; the deferred output gradients
      // (the logits' among them) are held until then.
      const int64_t head = slots[0]->layout().lm_head;
      EXPECT_EQ(split[static_cast<std::size_t>(head)], 0.0f);
      // One micro-batch's deferred output gradients, as the estimate counts them.
      EXPECT_EQ(slots[0]->deferred_bytes(), deferred_grad_parts(cfg, kB, kT, lp).total());
      EXPECT_GE(slots[0]->activation_bytes() - held, slots[0]->deferred_bytes());
      moetrain::testing::expect_error([&] { forward(0); }, {"weight_backward"});
      for (int k = 0; k < 2; ++k) slots[k]->weight_backward(split.data());
      EXPECT_EQ(calls, whole_calls);
      int64_t differ = 0;
      for (std::size_t i = 0; i < whole.size(); ++i) differ += whole[i] != split[i];
      EXPECT_EQ(differ, 0) << "of " << whole.size() << " gradients";
      EXPECT_NE(split[static_cast<std::size_t>(head)], 0.0f);
    }
  Transformer full(cfg);
  full.set_recompute(Recompute::Full);
  moetrain::testing::expect_error([&] { full.set_split_backward(true); },
                                  {"train.recompute = full"});
}

}  // namespace
