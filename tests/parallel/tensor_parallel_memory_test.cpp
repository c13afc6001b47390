// The activations a tensor-parallel rank holds (dist.tp = 2; neighbouring pairs of processes)
// after a training forward, measured by the model (Transformer::activation_bytes), against what
// the trainer's memory estimate counts (trainer_layout, rank_memory: tp_activation_parts), in f32 and
// bf16 under each recomputation mode, without and with sequence parallelism (which must undercut
// tensor parallelism alone); and against the one-process count, which both must undercut.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <vector>

#include "core/dtype.h"

#include "model/params.h"
#include "model/transformer.h"
#include "parallel/runtime.h"
#include "train/memory_estimate.h"
#include "train/run_config.h"

using namespace moetrain;

namespace {

constexpr int64_t kTp = 2, kB = 2, kT = 16;

// 3 blocks (the last a dense FFN), 4 heads over 2 key-value heads, a shared expert; top-4 of 4
// experts routes every token to every expert, so that the rows are N·K exactly, as the count
// takes them (dropless, balanced).
ModelConfig config() {
  ModelConfig c;
  c.vocab_size = 256;
  c.dim = 32;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.expert_hidden = 24;
  c.n_experts = 4;
  c.top_k = 4;
  c.shared_expert_hidden = 16;
  c.dense_every = 3;
  c.max_seq_len = kT;
  return c;
}

}  // namespace

TEST(TensorParallelMemory, ActivationsAreWhatTheEstimateCounts) {
  auto world = dist_world("tp_memory");
  ASSERT_EQ(world->size() % kTp, 0) << "run with a multiple of 2 processes";
  auto tp = world->split(world->rank() / kTp, world->rank(), {"tensor"});
  const ModelConfig c = config();
  for (const bool sp : {false, true}) {
    for (const DType lp : {DType::F32, DType::BF16})
      for (const Recompute r : {Recompute::None, Recompute::Moe, Recompute::Full}) {
        SCOPED_TRACE(fmt::format("{} {}{}", dtype_name(lp), recompute_name(r),
                                 sp ? " sequence-parallel" : ""));
        Transformer model(c);
        model.set_precision(lp);
        model.set_recompute(r);
        model.set_tensor_parallel(tp.get(), sp);
        std::vector<float> params(static_cast<std::size_t>(model.layout().size()));
        init_params(params.data(), model.layout(), c, 7);
        std::vector<int32_t> in(kB * kT), tg(kB * kT);
        for (int64_t i = 0; i < kB * kT; ++i)
          in[i] = static_cast<int32_t>(i % c.vocab_size),
          tg[i] = static_cast<int32_t>((i + 1) % c.vocab_size);
        model.forward(params.data(), in.data(), tg.data(), kB, kT, MoeStep{});
        const double got = static_cast<double>(model.activation_bytes());
        // The trainer's estimate for this run, without the backward buffers and workspace its
        // layers keep besides (the model does not count them).
        RunConfig rc;
        rc.model = c;
        rc.train.batch_size = kB, rc.train.seq_len = kT;
        rc.train.precision = lp == DType::F32 ? Precision::F32 : Precision::BF16;
        rc.train.recompute = r;
        rc.dist.tp = kTp;
        rc.dist.sequence_parallel = sp;
        RankLayout l = trainer_layout(rc, world->size(), 0);
        ASSERT_EQ(l.tp, kTp);
        ASSERT_TRUE(l.whole_params_under_tp);
        ASSERT_EQ(l.sequence_parallel, sp);
        l.kept_backward_buffers = false;
        const double want = rank_memory(c, kB, kT, l).activations;
        EXPECT_EQ(want,
                  static_cast<double>(tp_activation_parts(c, kB, kT, r, lp, kTp, sp).total()));
        // Sequence parallelism holds less than tensor parallelism alone.
        if (sp) {
          EXPECT_LT(want,
                    static_cast<double>(tp_activation_parts(c, kB, kT, r, lp, kTp).total()));
        }
        // The one-process count's bound (tests/model/recompute_test.cpp): what it leaves out is
        // the router's backward scratch, under 2% of the whole.
        EXPECT_NEAR(got, want, 0.02 * want);
        EXPECT_LT(want, static_cast<double>(activation_parts(c, kB, kT, r, lp).total()));
      }
  }
}
