// Per-rank step times in metrics.jsonl under MPI: one positive entry per rank, and a rank slowed
// by fault injection (MOETRAIN_FAULT=slow, set before the trainer's first step) is the largest.
// Its own program: the fault is armed once per process and would slow every other test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/metrics.h"
#include "parallel/runtime.h"
#include "support/corpus.h"
#include "support/shared_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

TEST(RankTiming, EveryRanksStepTimeAndTheSlowRankIsTheMax) {
  constexpr int kSlowRank = 1;
  constexpr int64_t kSteps = 6, kSlowMs = 60;
  ::setenv("MOETRAIN_FAULT",
           ("slow:rank=" + std::to_string(kSlowRank) + ":step=2:ms=" + std::to_string(kSlowMs))
               .c_str(),
           1);
  auto world = dist_world("rank_timing");
  const int W = world->size();
  SharedDir dir(*world, "rank_timing");
  if (world->rank() == 0) write_corpus(dir / "data", 20000);
  world->barrier();
  RunConfig cfg = load_run_config(
      "", {"model.dim=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
           "model.expert_hidden=16", "model.n_experts=4", "model.top_k=2", "model.max_seq_len=8",
           "train.batch_size=2", "train.seq_len=8", "train.steps=" + std::to_string(kSteps),
           "train.eval_every=0", "train.checkpoint_every=0", "train.progress=off",
           "data.dir=" + (dir / "data").string(), "train.run_dir=" + (dir / "run").string()});
  Trainer t(cfg, false, dist_world("rank_timing_train"));
  t.run();
  world->barrier();
  if (world->rank() != 0) return;
  int64_t lines = 0;
  for (const nlohmann::json& j : read_metrics(dir / "run")) {
    if (!j.contains("step_time_s")) continue;
    ++lines;
    const int64_t step = j["step"].get<int64_t>();
    ASSERT_TRUE(j.contains("rank_step_time_s")) << j.dump();
    ASSERT_TRUE(j.contains("rank_compute_s")) << j.dump();
    const auto times = j["rank_step_time_s"].get<std::vector<double>>();
    ASSERT_EQ(times.size(), static_cast<std::size_t>(W));
    for (double s : times) EXPECT_GT(s, 0) << "step " << step;
    EXPECT_EQ(times[0], j["step_time_s"].get<double>()) << "rank 0's entry is its own time";
    if (step >= 2) {
      const auto slowest = std::max_element(times.begin(), times.end()) - times.begin();
      EXPECT_EQ(slowest, kSlowRank) << "step " << step << ": " << j.dump();
      EXPECT_GE(times[kSlowRank], kSlowMs * 1e-3);
    }
  }
  EXPECT_EQ(lines, kSteps);
}
