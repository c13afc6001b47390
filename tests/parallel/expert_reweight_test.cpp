// Expert gradient reweighting under data and expert parallelism against the single-process run
// with the same global batch and seed: the factors come from the reduced gradient (and loads),
// so every layout reweights as one process does, with clipping active.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "parallel/runtime.h"
#include "support/corpus.h"
#include "support/held_values.h"
#include "support/shared_dir.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kRowsPerRank = 2;
constexpr int64_t kSteps = 12;

struct RunSetup {
  std::string reweight;
  int64_t ep = 1, zero = 0;
};

RunConfig make_config(const RunSetup& s, const fs::path& data, const fs::path& run, int64_t batch) {
  return load_run_config(
      "", {"model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
           "model.expert_hidden=24", "model.n_experts=4", "model.top_k=2", "model.max_seq_len=16",
           "train.batch_size=" + std::to_string(batch), "train.seq_len=16",
           "train.steps=" + std::to_string(kSteps), "train.eval_every=0", "train.eval_batches=2",
           "train.progress=off", "optim.warmup_steps=3",
           // Small enough that every step clips: the factors must come before it.
           "optim.grad_clip=0.05", "grad.expert_reweight=" + s.reweight, "grad.util_low=0.9",
           "grad.util_high=1.1", "data.dir=" + data.string(), "train.run_dir=" + run.string(),
           "dist.ep=" + std::to_string(s.ep), "dist.zero=" + std::to_string(s.zero),
           "dist.bucket_first_mb=0.01", "dist.bucket_mb=0.05"});
}

std::vector<nlohmann::json> step_lines(const fs::path& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j);
  }
  return out;
}

double rel(double a, double b) {
  return std::abs(a - b) / std::max(1e-30, std::abs(b));
}

void expect_matches_single(const RunSetup& s) {
  auto world = dist_world("reweight");
  SharedDir dir(*world, "dist_reweight");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  std::vector<float> ref;
  std::vector<nlohmann::json> ref_lines;
  {
    TempDir run("single");
    RunSetup one = s;
    one.ep = 1, one.zero = 0;
    Trainer t(make_config(one, dir / "data", run.path(), kRowsPerRank * world->size()), false,
              make_local_comm());
    t.run();
    ref = t.params();
    ref_lines = step_lines(run.path());
  }
  Trainer t(make_config(s, dir / "data", dir / "run", kRowsPerRank), false,
            dist_world("reweight_train"));
  t.run();
  const std::vector<float>& got = t.params();
  const std::vector<char> held = held_values(t);
  double worst = 0, scale = 1e-30;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!held[i]) continue;
    worst = std::max(worst, std::abs(double(got[i]) - ref[i]));
    scale = std::max(scale, std::abs(double(ref[i])));
  }
  EXPECT_LE(worst / scale, 1e-4) << s.reweight << " ep " << s.ep << " zero " << s.zero;
  if (world->rank() != 0) return;
  const std::vector<nlohmann::json> lines = step_lines(dir / "run");
  ASSERT_EQ(lines.size(), static_cast<std::size_t>(kSteps));
  ASSERT_EQ(ref_lines.size(), static_cast<std::size_t>(kSteps));
  for (std::size_t i = 0; i < lines.size(); ++i) {
    EXPECT_LE(rel(lines[i]["loss"], ref_lines[i]["loss"]), 1e-5) << s.reweight << " step " << i;
    EXPECT_LE(rel(lines[i]["grad_norm"], ref_lines[i]["grad_norm"]), 1e-4)
        << s.reweight << " step " << i;
    EXPECT_GT(lines[i]["grad_norm"].get<double>(), 0.05) << "clipping is not active";
    const auto lo = lines[i]["expert_reweight_min"].get<std::vector<double>>();
    const auto lo_ref = ref_lines[i]["expert_reweight_min"].get<std::vector<double>>();
    const auto hi = lines[i]["expert_reweight_max"].get<std::vector<double>>();
    const auto hi_ref = ref_lines[i]["expert_reweight_max"].get<std::vector<double>>();
    ASSERT_EQ(lo.size(), lo_ref.size());
    for (std::size_t l = 0; l < lo.size(); ++l) {
      EXPECT_LE(rel(lo[l], lo_ref[l]), 1e-4) << s.reweight << " step " << i << " layer " << l;
      EXPECT_LE(rel(hi[l], hi_ref[l]), 1e-4) << s.reweight << " step " << i << " layer " << l;
    }
  }
}

}  // namespace

TEST(DistReweight, DataParallelMatchesOneProcessInEveryMode) {
  for (const char* mode : {"importance", "utilisation", "grad_norm"}) expect_matches_single({mode});
}

TEST(DistReweight, ZeroOneMatchesOneProcess) {
  expect_matches_single({"importance", 1, 1});
}

TEST(DistReweight, ExpertParallelMatchesOneProcess) {
  const int W = dist_world("reweight_ep")->size();
  expect_matches_single({"grad_norm", W});
  expect_matches_single({"utilisation", W});
}
