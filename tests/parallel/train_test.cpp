// The distributed trainer against the single-process run with the same global batch and seed:
// expert parallel, data parallel, both, and ZeRO-1 (bitwise equal to replicated AdamW), with
// checkpoints that hold the whole model and resume on another layout.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/check.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "model/params.h"
#include "parallel/runtime.h"
#include "support/checkpoint_tensors.h"
#include "support/corpus.h"
#include "support/held_values.h"
#include "support/run_metrics.h"
#include "support/shared_dir.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kRowsPerRank = 2;
constexpr int64_t kSteps = 20;

struct RunSetup {
  std::string router = "topk_softmax";
  int64_t grad_accum = 1, shared_hidden = 0, ep = 1, zero = 0, checkpoint_every = 0;
  int64_t ranks_per_node = -1;  // ≥ 0: the 2-D all-to-all
  int64_t a2a_chunks = 1;
  bool overlap = true;  // gradient buckets reduced during backward
};

RunConfig make_config(const RunSetup& s, const fs::path& data, const fs::path& run, int64_t batch) {
  return load_run_config(
      "", {"model.dim=32",
           "model.n_layers=2",
           "model.n_heads=4",
           "model.n_kv_heads=2",
           "model.expert_hidden=24",
           "model.n_experts=4",
           "model.top_k=2",
           "model.router=" + s.router,
           "model.max_seq_len=16",
           "model.shared_expert_hidden=" + std::to_string(s.shared_hidden),
           "model.bias_update_rate=0.01",
           "train.batch_size=" + std::to_string(batch),
           "train.seq_len=16",
           "train.steps=" + std::to_string(kSteps),
           "train.grad_accum=" + std::to_string(s.grad_accum),
           "train.eval_every=10",
           "train.eval_batches=2",
           "train.checkpoint_every=" + std::to_string(s.checkpoint_every),
           "train.keep_checkpoints=3",
           "train.progress=off",
           "optim.warmup_steps=3",
           "optim.grad_clip=0.5",
           "data.dir=" + data.string(),
           "train.run_dir=" + run.string(),
           "dist.ep=" + std::to_string(s.ep),
           "dist.zero=" + std::to_string(s.zero),
           "dist.bucket_first_mb=0.01",
           "dist.bucket_mb=0.05",
           std::string("dist.hierarchical=") + (s.ranks_per_node >= 0 ? "true" : "false"),
           "dist.ranks_per_node=" + std::to_string(std::max<int64_t>(0, s.ranks_per_node)),
           "dist.a2a_chunks=" + std::to_string(s.a2a_chunks),
           std::string("dist.overlap=") + (s.overlap ? "true" : "false")});
}

struct Outcome {
  std::vector<float> params;
  std::vector<char> held;  // 1 where this rank holds the value: all but others' experts
  std::vector<double> losses, val_losses, grad_norms;  // rank 0 only
};

// The single-process run with the whole global batch, on every rank (it is local to each).
Outcome run_single(const RunSetup& s, const fs::path& data, int world) {
  TempDir run("single");
  RunSetup one = s;
  one.ep = 1, one.zero = 0;
  Trainer t(make_config(one, data, run.path(), kRowsPerRank * world), false, make_local_comm());
  t.run();
  return {t.params(), std::vector<char>(t.params().size(), 1), metric(run.path(), "loss"),
          metric(run.path(), "val_loss"), metric(run.path(), "grad_norm")};
}

Outcome run_distributed(const RunSetup& s, const fs::path& data, const fs::path& run,
                        int64_t stop_at = -1, bool resume = false) {
  Trainer t(make_config(s, data, run, kRowsPerRank), resume, dist_world("train_test"));
  t.run(stop_at);
  Outcome o{t.params(), held_values(t), {}, {}, {}};
  if (t.rank() == 0) {
    o.losses = metric(run, "loss"), o.val_losses = metric(run, "val_loss");
    o.grad_norms = metric(run, "grad_norm");
  }
  return o;
}

// The parameters this rank holds agree with `ref` (max difference over max magnitude).
void expect_params_close(const Outcome& got, const std::vector<float>& ref, double tol) {
  ASSERT_EQ(got.params.size(), ref.size());
  double worst = 0, scale = 1e-30;
  int64_t held = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!got.held[i]) continue;
    ++held;
    worst = std::max(worst, std::abs(double(got.params[i]) - ref[i]));
    scale = std::max(scale, std::abs(double(ref[i])));
  }
  EXPECT_GT(held, 0);
  EXPECT_LE(worst / scale, tol);
}

void expect_matches_single(const RunSetup& s) {
  auto world = dist_world("equiv");
  SharedDir dir(*world, "dist_equiv");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  Outcome ref = run_single(s, dir / "data", world->size());
  Outcome got = run_distributed(s, dir / "data", dir / "run");
  if (world->rank() == 0) {
    ASSERT_EQ(got.losses.size(), static_cast<std::size_t>(kSteps));
    ASSERT_EQ(ref.losses.size(), static_cast<std::size_t>(kSteps));
    EXPECT_LE(max_rel(got.losses, ref.losses), 1e-5);
    EXPECT_LT(got.losses.back(), got.losses.front());
    // AdamW hardly sees the gradient's scale; the norm does.
    ASSERT_EQ(got.grad_norms.size(), ref.grad_norms.size());
    EXPECT_LE(max_rel(got.grad_norms, ref.grad_norms), 1e-4);
    ASSERT_EQ(got.val_losses.size(), ref.val_losses.size());
    EXPECT_LE(max_rel(got.val_losses, ref.val_losses), 1e-5);
  }
  expect_params_close(got, ref.params, 1e-4);
  // The checkpoint holds the whole model: every rank finds its values there, bit for bit.
  LoadedModel m = load_model(dir / "run");
  EXPECT_EQ(m.step, kSteps);
  ASSERT_EQ(m.params.size(), got.params.size());
  int64_t differ = 0;
  for (std::size_t i = 0; i < m.params.size(); ++i)
    differ += got.held[i] && m.params[i] != got.params[i];
  EXPECT_EQ(differ, 0) << "checkpointed parameters differ from their holder's";
}

}  // namespace

TEST(DistTrain, ExpertParallelMatchesOneProcess) {
  RunSetup s;
  s.ep = dist_world("ep")->size();
  expect_matches_single(s);
}

TEST(DistTrain, OverlappedChunkedAllToAllMatchesOneProcess) {
  RunSetup s;
  s.ep = dist_world("chunks")->size();
  s.a2a_chunks = 3;
  expect_matches_single(s);
}

TEST(DistTrain, DataParallelMatchesOneProcessWithAccumulationAndRouterBias) {
  RunSetup s;
  s.ep = 1, s.grad_accum = 2, s.router = "sigmoid_bias";
  expect_matches_single(s);
}

TEST(DistTrain, NoisyTopKDrawsTheOneProcessNoiseWhenSplit) {
  // The router noise of a token depends on its place in the global batch, not on the rank that
  // holds it: data and expert parallel runs route exactly as the one-process run.
  RunSetup s;
  s.router = "noisy_topk";
  s.ep = dist_world("noisy")->size();
  expect_matches_single(s);
  s.ep = 1;
  expect_matches_single(s);
}

TEST(DistTrain, DataTimesExpertParallelMatchesOneProcess) {
  const int W = dist_world("dpxep")->size();
  if (W < 4) GTEST_SKIP() << "needs 4 processes for DP x EP = 2 x 2";
  RunSetup s;
  s.ep = 2, s.shared_hidden = 16;
  expect_matches_single(s);
}

TEST(DistTrain, ResumeIsBitExactAndZeroOneEqualsReplicatedAndResumesOnAnotherLayout) {
  auto world = dist_world("zero");
  const int W = world->size();
  SharedDir dir(*world, "dist_zero");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  RunSetup s;
  s.ep = W >= 4 ? 2 : W, s.checkpoint_every = 10;
  Outcome plain = run_distributed(s, dir / "data", dir / "plain");
  // 10 steps, a restart from the checkpoint every rank wrote its share of, 10 more: the bits of
  // 20 straight steps.
  run_distributed(s, dir / "data", dir / "plain_resumed", 10);
  Outcome plain_resumed = run_distributed(s, dir / "data", dir / "plain_resumed", -1, true);
  s.zero = 1;
  Outcome zero = run_distributed(s, dir / "data", dir / "zero");
  auto same_held = [](const Outcome& a, const Outcome& b) {
    return differ_held(a.params, b.params, a.held);
  };
  EXPECT_EQ(same_held(plain, zero), 0) << "ZeRO-1 parameters differ from replicated AdamW";
  EXPECT_EQ(same_held(plain_resumed, plain), 0) << "resumed run differs from the straight one";
  if (world->rank() == 0) {
    EXPECT_EQ(plain.losses, zero.losses);
    EXPECT_EQ(plain.losses, plain_resumed.losses);
    // The same tensors, though one run wrote whole tensors and the other ZeRO-1 slices.
    const std::string step = "checkpoints/step_00000020";
    auto plain_ckpt = read_all_tensors(dir / ("plain/" + step));
    auto zero_ckpt = read_all_tensors(dir / ("zero/" + step));
    EXPECT_GT(plain_ckpt.size(), 0u);
    EXPECT_TRUE(plain_ckpt == zero_ckpt);
    EXPECT_GT(read_checkpoint_json(dir / ("zero/" + step), "manifest.json")["tensors"]["optimizer"]
                  .size(),
              0u);
  }
  // Interrupted at step 10 and resumed with ZeRO-1 on the same layout: the same bits.
  run_distributed(s, dir / "data", dir / "resumed", 10);
  Outcome resumed = run_distributed(s, dir / "data", dir / "resumed", -1, true);
  EXPECT_EQ(same_held(resumed, zero), 0) << "resumed ZeRO-1 run differs";
  if (world->rank() == 0) {
    EXPECT_EQ(resumed.losses, zero.losses);
  }
  // The step-10 checkpoint of the ZeRO run, resumed as pure data parallelism without ZeRO.
  if (world->rank() == 0) {
    fs::create_directories(dir / "relayout/checkpoints");
    fs::copy(dir / "zero/checkpoints/step_00000010", dir / "relayout/checkpoints/step_00000010");
    std::ofstream(dir / "relayout/checkpoints/latest") << "step_00000010";
    fs::copy_file(dir / "zero/metrics.jsonl", dir / "relayout/metrics.jsonl");
  }
  world->barrier();
  RunSetup other = s;
  other.ep = 1, other.zero = 0;
  Outcome relayout = run_distributed(other, dir / "data", dir / "relayout", -1, true);
  if (world->rank() == 0) {
    ASSERT_EQ(relayout.losses.size(), zero.losses.size());
    EXPECT_LE(max_rel(relayout.losses, zero.losses), 1e-5);
  }
}

TEST(DistTrain, HierarchicalAllToAllAndOverlapChangeNoBit) {
  auto world = dist_world("hier");
  const int W = world->size();
  SharedDir dir(*world, "dist_hier");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  RunSetup s;
  s.ep = W >= 4 ? 2 : W;
  s.overlap = false;
  Outcome blocking = run_distributed(s, dir / "data", dir / "blocking");
  s.overlap = true;
  Outcome flat = run_distributed(s, dir / "data", dir / "flat");
  EXPECT_EQ(0, std::memcmp(flat.params.data(), blocking.params.data(),
                           flat.params.size() * sizeof(float)))
      << "reducing during backward changed the result";
  if (world->rank() == 0) {
    EXPECT_EQ(flat.losses, blocking.losses);
  }
  s.ranks_per_node = 1;  // every rank its own node: both stages carry traffic
  Outcome two_d = run_distributed(s, dir / "data", dir / "two_d");
  EXPECT_EQ(
      0, std::memcmp(flat.params.data(), two_d.params.data(), flat.params.size() * sizeof(float)));
  if (world->rank() == 0) {
    EXPECT_EQ(flat.losses, two_d.losses);
  }
}

TEST(DistTrain, LayoutsThatCannotSplitAreRefused) {
  auto world = dist_world("refuse");
  SharedDir dir(*world, "dist_refuse");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  RunSetup s;
  s.ep = world->size() + 1;  // does not divide the world
  EXPECT_THROW(Trainer(make_config(s, dir / "data", dir / "run", 2), false, dist_world("t")),
               Error);
  s.ep = world->size();
  RunConfig c = make_config(s, dir / "data", dir / "run", 2);
  c.model.n_experts = world->size() + 1;  // does not split over the EP group
  EXPECT_THROW(Trainer(c, false, dist_world("t")), Error);
}

// A setting that changes control flow (when to evaluate, which data) differs on rank 1: every
// rank stops at start-up naming the key and both values, instead of hanging in a collective the
// others never enter or training on different data.
TEST(DistTrain, RanksThatDisagreeOnASettingStopAtStartNamingIt) {
  auto world = dist_world("agree");
  SharedDir dir(*world, "dist_agree");
  if (world->rank() == 0) {
    write_corpus(dir / "data", 40000);
    fs::copy(dir / "data", dir / "other");
  }
  world->barrier();
  auto expect_refused = [&](const char* run, auto change, const std::string& message) {
    RunConfig cfg = make_config(RunSetup{}, dir / "data", dir / run, kRowsPerRank);
    if (world->rank() == 1) change(cfg);
    try {
      Trainer t(cfg, false, dist_world("agree_run"));
      ADD_FAILURE() << "rank " << world->rank() << " started despite " << message;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  expect_refused("eval", [](RunConfig& c) { c.train.eval_every = 5; },
                 "rank 1 has train.eval_every = 5, rank 0 has train.eval_every = 10");
  expect_refused("data", [&](RunConfig& c) { c.data.dir = (dir / "other").string(); },
                 "rank 1 has data.dir = \"" + (dir / "other").string() + "\", rank 0 has data.dir = \"" +
                     (dir / "data").string() + "\"");
}
