// Sparse expert gradients in the trainer (grad.sparse_experts): an expert no token reached keeps
// its parameters and Adam moments bit for bit; with every expert reached the run is the dense one;
// an interrupted run resumes bit-exactly; the classifier takes the same path; the keys refuse what
// they cannot do.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "optim/sparse_experts.h"
#include "optim/sharded_optimizer.h"
#include "support/corpus.h"
#include "support/expect_error.h"
#include "support/run_metrics.h"
#include "support/small_run.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/classifier_config.h"
#include "train/classifier_trainer.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

// 8 experts, top-1, one sequence of 8 tokens a step: most experts get no token in a step.
RunConfig sparse_run(const TempDir& tmp, std::vector<std::string> extra) {
  write_corpus(tmp / "data", 40000);
  std::vector<std::string> keys = small_run_keys(tmp);
  for (const char* k : {"model.n_experts=8", "model.top_k=1", "train.batch_size=1",
                        "train.seq_len=8", "optim.weight_decay=0.1"})
    keys.push_back(k);
  keys.insert(keys.end(), extra.begin(), extra.end());
  return load_run_config("", keys);
}

bool same_bits(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, static_cast<std::size_t>(n) * sizeof(float)) == 0;
}

bool all_zero(const float* a, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (a[i] != 0.0f) return false;
  return true;
}

}  // namespace

TEST(SparseExpertsTrain, UntouchedExpertsKeepParamsAndAdamMomentsBitwise) {
  TempDir tmp("sparse_untouched");
  Trainer t(sparse_run(tmp, {"grad.sparse_experts=true"}), false);
  const std::vector<ExpertPiece> pieces = expert_pieces(t.model().layout());
  ShardedOptimizer& opt = t.optimizer();
  ASSERT_EQ(opt.pieces().size(), 1u);  // one process: one piece, the whole buffer
  int64_t kept_with_history = 0, moved = 0;
  for (int64_t step = 1; step <= 6; ++step) {
    const std::vector<float> params = t.params();
    const std::vector<float> m(opt.piece_state(0, 0).begin(), opt.piece_state(0, 0).end());
    const std::vector<float> v(opt.piece_state(0, 1).begin(), opt.piece_state(0, 1).end());
    t.run(step);
    const float* g = t.grads().data();
    for (const ExpertPiece& p : pieces) {
      const float* now = t.params().data() + p.offset;
      if (all_zero(g + p.offset, p.size)) {  // no token reached this expert this step
        EXPECT_TRUE(same_bits(now, params.data() + p.offset, p.size))
            << "step " << step << " expert key " << p.key << ": parameters changed";
        EXPECT_TRUE(same_bits(opt.piece_state(0, 0).data() + p.offset, m.data() + p.offset, p.size))
            << "step " << step << " expert key " << p.key << ": exp_avg changed";
        EXPECT_TRUE(same_bits(opt.piece_state(0, 1).data() + p.offset, v.data() + p.offset, p.size))
            << "step " << step << " expert key " << p.key << ": exp_avg_sq changed";
        // A dense step would move it: decay always, momentum once it has a history.
        kept_with_history += !all_zero(m.data() + p.offset, p.size);
      } else {
        moved += !same_bits(now, params.data() + p.offset, p.size);
      }
    }
  }
  EXPECT_GT(kept_with_history, 0) << "no expert was left untouched after having been updated";
  EXPECT_GT(moved, 0);
  const std::vector<double> frozen = metric(tmp / "run", "experts_frozen");
  ASSERT_EQ(frozen.size(), 6u);
  for (double f : frozen) EXPECT_GT(f, 0);
}

TEST(SparseExpertsTrain, EveryExpertTouchedEqualsDenseBitwise) {
  // 4 experts, top-2, 4 × 32 tokens a step: every expert is reached in every step.
  std::vector<float> dense, sparse;
  for (bool on : {false, true}) {
    TempDir tmp(on ? "sparse_on" : "sparse_off");
    write_corpus(tmp / "data", 40000);
    std::vector<std::string> keys = small_run_keys(tmp);
    keys.push_back("train.steps=4");
    keys.push_back(std::string("grad.sparse_experts=") + (on ? "true" : "false"));
    Trainer t(load_run_config("", keys), false);
    t.run();
    (on ? sparse : dense) = t.params();
    if (on) {
      for (double f : metric(tmp / "run", "experts_frozen")) EXPECT_EQ(f, 0);
    }
  }
  ASSERT_EQ(dense.size(), sparse.size());
  EXPECT_TRUE(same_bits(dense.data(), sparse.data(), static_cast<int64_t>(dense.size())));
}

TEST(SparseExpertsTrain, InterruptedRunResumesBitExactly) {
  TempDir straight("sparse_straight"), resumed("sparse_resumed");
  const std::vector<std::string> extra = {"grad.sparse_experts=true", "train.grad_accum=2",
                                          "grad.min_accum_fraction=0.5"};
  std::vector<float> a, b;
  {
    Trainer t(sparse_run(straight, extra), false);
    t.run();
    a = t.params();
  }
  {
    Trainer t(sparse_run(resumed, extra), false);
    t.run(3);
  }
  {
    Trainer t(sparse_run(resumed, extra), true);
    EXPECT_EQ(t.step(), 3);
    t.run();
    b = t.params();
  }
  ASSERT_EQ(a.size(), b.size());
  EXPECT_TRUE(same_bits(a.data(), b.data(), static_cast<int64_t>(a.size())));
  EXPECT_EQ(metric(straight / "run", "loss"), metric(resumed / "run", "loss"));
}

TEST(SparseExpertsTrain, KeysRefuseWhatTheyCannotDo) {
  TempDir tmp("sparse_keys");
  expect_error([&] { sparse_run(tmp, {"grad.min_accum_fraction=0.5"}); },
               "grad.min_accum_fraction = 0.5 needs grad.sparse_experts = true");
  expect_error(
      [&] {
        sparse_run(tmp, {"grad.sparse_experts=true", "grad.min_accum_fraction=2"});
      },
      "grad.min_accum_fraction = 2: must be in [0, 1]");
}

TEST(SparseExpertsTrain, ClassifierLeavesUntouchedExpertsAsTheyWere) {
  // 8 experts, top-1, 2 rows a step: at least 6 experts of each layer get no row in a step. With
  // sparse gradients some keep their initial bits after two steps; dense weight decay moves all.
  int64_t unchanged[2] = {0, 0};
  for (bool on : {false, true}) {
    TempDir tmp(on ? "cls_sparse" : "cls_dense");
    ClassifierTrainer t(load_classifier_config(
        "", {"model.dim=16", "model.n_layers=2", "model.expert_hidden=8", "model.n_experts=8",
             "model.top_k=1", "train.steps=2", "train.batch_size=2", "train.eval_every=0",
             "train.eval_batch_size=512", "train.progress=off", "optim.warmup_steps=1",
             "train.run_dir=" + (tmp / "run").string(),
             std::string("grad.sparse_experts=") + (on ? "true" : "false")}));
    const std::vector<float> init = t.params();
    t.run();
    for (const ExpertPiece& p : expert_pieces(t.model().layout()))
      unchanged[on] += same_bits(t.params().data() + p.offset, init.data() + p.offset, p.size);
  }
  EXPECT_EQ(unchanged[0], 0);
  EXPECT_GT(unchanged[1], 0);
}
