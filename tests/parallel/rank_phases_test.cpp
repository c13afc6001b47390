// The per-rank phase profile (train.profile) under MPI: every phase of core/profile.h as one
// entry per rank, each rank's phases and its time in no phase adding up to its step time, and the
// communication phases non-zero where the layout communicates (expert parallel: the all-to-all
// waits; every run: the step's collectives). Without train.profile, no profile figures at all.
#include <gtest/gtest.h>

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/profile.h"
#include "io/metrics.h"
#include "parallel/runtime.h"
#include "support/corpus.h"
#include "support/shared_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kSteps = 3;

std::vector<nlohmann::json> train(Comm& world, const fs::path& dir, const std::string& name,
                                  bool profile, int ep) {
  RunConfig cfg = load_run_config(
      "", {"model.dim=16", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
           "model.expert_hidden=16", "model.n_experts=4", "model.top_k=2", "model.max_seq_len=8",
           "train.batch_size=2", "train.seq_len=8", "train.steps=" + std::to_string(kSteps),
           "train.eval_every=0", "train.checkpoint_every=0", "train.progress=off",
           "train.tensorboard=false", "dist.ep=" + std::to_string(ep),
           std::string("train.profile=") + (profile ? "true" : "false"),
           "data.dir=" + (dir / "data").string(), "train.run_dir=" + (dir / name).string()});
  {
    Trainer t(cfg, false, dist_world("rank_phases_train"));
    t.run();
  }
  world.barrier();
  std::vector<nlohmann::json> steps;
  for (const nlohmann::json& j : read_metrics(dir / name))
    if (j.contains("step_time_s")) steps.push_back(j);
  return steps;
}

}  // namespace

TEST(RankPhases, EachRanksPhasesAddUpToItsStep) {
  auto world = dist_world("rank_phases");
  const int W = world->size();
  const int ep = W % 2 == 0 ? 2 : 1;
  SharedDir dir(*world, "rank_phases");
  if (world->rank() == 0) write_corpus(dir / "data", 20000);
  world->barrier();
  const std::vector<nlohmann::json> steps = train(*world, dir.path(), "profiled", true, ep);
  const std::vector<nlohmann::json> plain = train(*world, dir.path(), "plain", false, ep);
  if (world->rank() != 0) return;

  ASSERT_EQ(static_cast<int64_t>(steps.size()), kSteps);
  // The names as metrics keys, spelled out: a renamed phase or a changed key rule shows here.
  for (const char* key :
       {"profile_all_to_all_s", "profile_experts_fwd_bwd_data_s", "profile_permute_combine_s",
        "profile_collectives_s", "profile_gradient_reduction_s", "profile_other_s"})
    EXPECT_TRUE(steps[0].contains(key)) << key << " missing in " << steps[0].dump();
  for (const nlohmann::json& j : steps) {
    const int64_t step = j["step"].get<int64_t>();
    const auto step_s = j["rank_step_time_s"].get<std::vector<double>>();
    ASSERT_EQ(step_s.size(), static_cast<std::size_t>(W));
    std::vector<double> sum(W, 0.0);
    int phases = 0;
    for (const auto& [key, value] : j.items()) {
      if (key.rfind("profile_", 0) != 0) continue;
      ++phases;
      const auto per_rank = value.get<std::vector<double>>();
      ASSERT_EQ(per_rank.size(), static_cast<std::size_t>(W)) << key;
      for (int q = 0; q < W; ++q) {
        // Exclusive times inside the step; "other" is the step less them (>= 0 to a clock read).
        EXPECT_GE(per_rank[q], key == "profile_other_s" ? -1e-4 : 0.0)
            << key << " rank " << q << " step " << step;
        sum[q] += per_rank[q];
      }
    }
    EXPECT_EQ(phases, static_cast<int>(Phase::kCount) + 1) << j.dump();
    for (int q = 0; q < W; ++q) {
      EXPECT_NEAR(sum[q], step_s[q], 1e-9 * step_s[q] + 1e-12) << "rank " << q << " step " << step;
      EXPECT_GT(j["profile_collectives_s"][q].get<double>(), 0.0)
          << "rank " << q << ": the step's metrics are gathered on the compute thread";
      EXPECT_GT(j["profile_experts_fwd_bwd_data_s"][q].get<double>() +
                    j["profile_dense_gemm_s"][q].get<double>(),
                0.0);
      if (ep > 1) {
        EXPECT_GT(j["profile_all_to_all_s"][q].get<double>(), 0.0)
            << "rank " << q << ": expert parallel steps wait for their exchanges";
      }
    }
  }

  ASSERT_EQ(static_cast<int64_t>(plain.size()), kSteps);
  for (const nlohmann::json& j : plain)
    for (const auto& [key, value] : j.items())
      EXPECT_NE(key.rfind("profile_", 0), 0u) << key << " written without train.profile";
}
