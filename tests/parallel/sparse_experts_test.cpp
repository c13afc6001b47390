// Sparse expert gradients across processes: data-parallel, ZeRO-1 and expert-parallel runs with
// grad.sparse_experts agree with the one-process sparse run on the same global batch (every rank
// skips the same experts), and the skipped buckets are bytes not sent.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/params.h"
#include "parallel/runtime.h"
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

constexpr int64_t kSteps = 6;

struct SparseSetup {
  int64_t ep = 1, zero = 0, grad_accum = 1;
  bool overlap = true, sparse = true;
  double min_accum_fraction = 0;
  int64_t spare_slots = 0;  // hot-expert replicas per rank (placement.spare_slots)
};

// 8 experts, top-1, 8 tokens per process and micro-batch: most experts get no token in a step.
RunConfig make_config(const SparseSetup& s, const fs::path& data, const fs::path& run,
                      int64_t rows) {
  return load_run_config("", {"model.dim=32",
                              "model.n_layers=2",
                              "model.n_heads=4",
                              "model.n_kv_heads=2",
                              "model.expert_hidden=24",
                              "model.n_experts=8",
                              "model.top_k=1",
                              "model.max_seq_len=8",
                              "train.batch_size=" + std::to_string(rows),
                              "train.seq_len=8",
                              "train.steps=" + std::to_string(kSteps),
                              "train.grad_accum=" + std::to_string(s.grad_accum),
                              "train.eval_every=0",
                              "train.eval_batches=1",
                              "train.progress=off",
                              "optim.warmup_steps=2",
                              "optim.grad_clip=0.5",
                              "data.dir=" + data.string(),
                              "train.run_dir=" + run.string(),
                              "dist.ep=" + std::to_string(s.ep),
                              "dist.zero=" + std::to_string(s.zero),
                              "dist.bucket_first_mb=0.01",
                              "dist.bucket_mb=0.05",
                              std::string("dist.overlap=") + (s.overlap ? "true" : "false"),
                              std::string("grad.sparse_experts=") + (s.sparse ? "true" : "false"),
                              "grad.min_accum_fraction=" + std::to_string(s.min_accum_fraction),
                              "placement.spare_slots=" + std::to_string(s.spare_slots),
                              "placement.every=2"});
}

double sum(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

void expect_matches_single(const SparseSetup& s) {
  auto world = dist_world("sparse");
  const int W = world->size();
  SharedDir dir(*world, "sparse_equiv");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  std::vector<float> ref;
  std::vector<double> ref_losses, ref_frozen;
  {
    TempDir run("sparse_single");
    SparseSetup one = s;
    one.ep = 1, one.zero = 0, one.spare_slots = 0;
    Trainer t(make_config(one, dir / "data", run.path(), W), false, make_local_comm());
    t.run();
    ref = t.params();
    ref_losses = metric(run.path(), "loss");
    ref_frozen = metric(run.path(), "experts_frozen");
  }
  Trainer t(make_config(s, dir / "data", dir / "run", 1), false, dist_world("sparse_run"));
  t.run();
  // The parameters this rank holds: all but other ranks' experts.
  const std::vector<char> held = held_values(t);
  double worst = 0, scale = 1e-30;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!held[i]) continue;
    worst = std::max(worst, std::abs(double(t.params()[i]) - ref[i]));
    scale = std::max(scale, std::abs(double(ref[i])));
  }
  EXPECT_LE(worst / scale, 1e-4) << "ep " << s.ep << " zero " << s.zero;
  if (world->rank() == 0) {
    const std::vector<double> losses = metric(dir / "run", "loss");
    ASSERT_EQ(losses.size(), ref_losses.size());
    for (std::size_t i = 0; i < losses.size(); ++i)
      EXPECT_LE(std::abs(losses[i] - ref_losses[i]) / std::abs(ref_losses[i]), 1e-5) << i;
    // The same experts were frozen in every step.
    EXPECT_EQ(metric(dir / "run", "experts_frozen"), ref_frozen);
    EXPECT_GT(sum(ref_frozen), 0);
    if (s.spare_slots > 0) {
      // Replication ran: some step placed more than one copy of an expert.
      double most = 0;
      std::ifstream in(dir / "run" / "metrics.jsonl");
      for (std::string line; std::getline(in, line);) {
        const auto j = nlohmann::json::parse(line);
        if (!j.contains("replicas_per_expert")) continue;
        for (double r : j["replicas_per_expert"].get<std::vector<double>>()) most = std::max(most, r);
      }
      EXPECT_GT(most, 1.0);
    }
  }
}

}  // namespace

TEST(SparseExpertsDist, DataParallelMatchesOneProcess) {
  expect_matches_single({});
}

TEST(SparseExpertsDist, ZeroOneWithoutOverlapMatchesOneProcess) {
  expect_matches_single({.zero = 1, .overlap = false});
}

TEST(SparseExpertsDist, ExpertParallelMatchesOneProcess) {
  expect_matches_single({.ep = dist_world("ep")->size()});
}

// Replicas compute with their expert's weights and hand their gradient to its owner before the
// step's reduction; the mask counts tokens per logical expert, wherever they were computed. So
// replication changes only the order of sums, within the tolerance of the other layouts.
TEST(SparseExpertsDist, ExpertParallelWithReplicasMatchesOneProcess) {
  expect_matches_single({.ep = dist_world("ep_replicas")->size(), .spare_slots = 1});
}

TEST(SparseExpertsDist, MinAccumFractionOverMicroBatchesMatchesOneProcess) {
  expect_matches_single({.grad_accum = 4, .min_accum_fraction = 0.5});
}

TEST(SparseExpertsDist, SkippedExpertBucketsAreBytesNotSent) {
  auto world = dist_world("bytes");
  SharedDir dir(*world, "sparse_bytes");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  double sent[2] = {0, 0}, skipped = 0;
  for (bool on : {false, true}) {
    const fs::path run = dir / (on ? "on" : "off");
    SparseSetup s;
    s.sparse = on;
    Trainer t(make_config(s, dir / "data", run, 1), false, dist_world("bytes_run"));
    t.run();
    if (world->rank() == 0) {
      sent[on] = sum(metric(run, "bytes_grad"));
      if (on) skipped = sum(metric(run, "bytes_grad_skipped"));
    }
  }
  if (world->rank() == 0) {
    EXPECT_GT(skipped, 0);
    EXPECT_LT(sent[1], sent[0]);
    // What was skipped is what was not sent (up to how the per-expert buckets split into chunks).
    EXPECT_NEAR(sent[1] + skipped, sent[0], 0.01 * sent[0]);
  }
}
