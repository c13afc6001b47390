// A known delay injected into every job of the communication thread (MOETRAIN_FAULT=comm_delay,
// rank 0, the rank that writes the metrics) shows in the step's communication figures: the
// thread's busy time holds every delayed job, and the compute thread waits for the all-to-alls
// it cannot compute without. Its own program: the fault is armed once per process.
#include <gtest/gtest.h>

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

TEST(CommDelay, TheInjectedDelayIsCommunicationTimeAndExposed) {
  constexpr int64_t kSteps = 3, kDelayMs = 40, kAccum = 2, kMoeLayers = 1;
  ::setenv("MOETRAIN_FAULT", ("comm_delay:rank=0:ms=" + std::to_string(kDelayMs)).c_str(), 1);
  auto world = dist_world("comm_delay");
  const int W = world->size();
  SharedDir dir(*world, "comm_delay");
  if (world->rank() == 0) write_corpus(dir / "data", 20000);
  world->barrier();
  RunConfig cfg = load_run_config("", {"model.dim=16",
                                       "model.n_layers=" + std::to_string(kMoeLayers),
                                       "model.n_heads=2",
                                       "model.n_kv_heads=1",
                                       "model.expert_hidden=16",
                                       "model.n_experts=4",
                                       "model.top_k=2",
                                       "model.max_seq_len=8",
                                       "train.batch_size=2",
                                       "train.seq_len=8",
                                       "train.grad_accum=" + std::to_string(kAccum),
                                       "train.steps=" + std::to_string(kSteps),
                                       "train.eval_every=0",
                                       "train.checkpoint_every=0",
                                       "train.progress=off",
                                       "dist.ep=" + std::to_string(W),
                                       "dist.overlap=true",
                                       "dist.a2a_chunks=1",
                                       "data.dir=" + (dir / "data").string(),
                                       "train.run_dir=" + (dir / "run").string()});
  ASSERT_EQ(cfg.model.n_moe_layers(), kMoeLayers);
  Trainer(cfg, false, dist_world("comm_delay_train")).run();
  world->barrier();
  if (world->rank() != 0) return;
  // Jobs per step on the communication thread: per MoE layer and micro-batch, the forward's
  // dispatch (with its plan) and combine and the backward's two, then at least one gradient
  // bucket. The compute thread waits for each exchange right after posting it.
  const double delay = kDelayMs * 1e-3;
  const int64_t a2a_jobs = 4 * kMoeLayers * kAccum;
  int64_t lines = 0;
  for (const nlohmann::json& j : read_metrics(dir / "run")) {
    if (!j.contains("step_time_s")) continue;
    ++lines;
    EXPECT_GE(j["comm_total_s"].get<double>(), (a2a_jobs + 1) * delay) << j.dump();
    // Half of each exchange's delay at least: robust to a busy machine delaying the wait.
    EXPECT_GE(j["comm_exposed_s"].get<double>(), 0.5 * a2a_jobs * delay) << j.dump();
    EXPECT_LE(j["comm_exposed_s"].get<double>(), j["comm_total_s"].get<double>()) << j.dump();
    EXPECT_GE(j["step_time_s"].get<double>(), j["comm_exposed_s"].get<double>()) << j.dump();
  }
  EXPECT_EQ(lines, kSteps);
}
