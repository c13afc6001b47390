// Whether `moetrain train` runs a layout: the planner's answer (trainer_runs, planner_only)
// against the trainer's own loader given the layout's keys, written here as `--set` would take
// them, over a grid of layouts. A layout the planner calls runnable loads; one it calls planner
// only is refused by the loader with the same message.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <utility>
#include <vector>

#include "parallel/pipeline_schedule.h"
#include "plan/cost_model.h"
#include "plan/layout.h"
#include "support/expect_error.h"
#include "support/plan_clusters.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::plan;

namespace {

// A small MoE model whose heads, key-value heads and vocabulary divide by 2 (tensor parallelism)
// and whose 4 layers take 2 stages of 2 chunks.
std::vector<std::string> base_keys(const std::string& run_dir) {
  return {"model.vocab_size=256", "model.dim=64",       "model.n_layers=4",
          "model.n_heads=4",      "model.n_kv_heads=2", "model.expert_hidden=128",
          "model.n_experts=4",    "model.top_k=2",      "model.max_seq_len=64",
          "train.batch_size=2",   "train.seq_len=32",   "train.grad_accum=4",
          "train.precision=bf16", "train.run_dir=" + run_dir};
}

// The layout's keys as a user would set them for `moetrain train`, written from the layout's
// fields (not through trainer_config, which this checks).
std::vector<std::string> layout_keys(const Layout& l) {
  std::vector<std::string> k = {fmt::format("dist.ep={}", l.ep), fmt::format("dist.etp={}", l.etp),
                                fmt::format("dist.tp={}", l.tp),
                                fmt::format("dist.pp={}", l.pp), fmt::format("dist.vp={}", l.vp)};
  if (l.pp > 1) k.push_back(fmt::format("dist.pp_schedule={}", pipe_schedule_name(l.pipe_schedule())));
  if (l.zero >= 0) k.push_back(fmt::format("dist.zero={}", l.zero));
  if (l.recompute) k.push_back(fmt::format("train.recompute={}", recompute_name(*l.recompute)));
  if (l.offload) k.push_back(fmt::format("dist.offload={}", *l.offload ? "host_file" : "none"));
  return k;
}

}  // namespace

TEST(PlanTrainerRuns, AgreesWithTheTrainersLoaderOnEveryLayout) {
  moetrain::testing::TempDir tmp("plan_trainer_runs");
  const std::vector<std::string> base = base_keys(tmp.path().string());
  const RunConfig cfg = load_run_config("", base);
  const ClusterSpec cluster = moetrain::testing::h100_nodes(1);
  int runs = 0, refused = 0;
  for (const int64_t tp : {1, 2})
    for (const int64_t pp : {1, 2})
      for (const int64_t vp : {1, 2})
        for (const auto& [ep, etp] : std::vector<std::pair<int64_t, int64_t>>{
                 {1, 1}, {2, 1}, {1, 2}, {2, 2}})
          for (const int64_t zero : {0, 1, 2, 3})
            for (const Recompute r : {Recompute::None, Recompute::Moe, Recompute::Full})
              for (const bool offload : {false, true})
                for (const PipeSchedule s : {PipeSchedule::GPipe, PipeSchedule::OneFOneB,
                                             PipeSchedule::ZeroBubble}) {
                  // Chunks a stage: interleaved (from 1f1b) or zero_bubble's chunked order.
                  if (vp > 1 && (pp == 1 || s == PipeSchedule::GPipe)) continue;
                  if (pp == 1 && s != PipeSchedule::OneFOneB) continue;
                  if (ep * etp > 4 / pp) continue;  // EP × ETP folds over a stage's ranks
                  Layout l{.procs = 4, .ep = ep, .tp = tp, .pp = pp, .vp = vp, .etp = etp};
                  if (pp > 1)
                    l.schedule = vp > 1 && s == PipeSchedule::OneFOneB ? PipeSchedule::Interleaved : s;
                  l.zero = zero, l.recompute = r, l.offload = offload;
                  ASSERT_EQ(layout_problem(cfg, cluster, l), "") << fmt::format(
                      "tp {} pp {} vp {} ep {}", tp, pp, vp, ep);
                  std::vector<std::string> keys = base;
                  for (const std::string& k : layout_keys(l)) keys.push_back(k);
                  const std::string loader =
                      moetrain::testing::error_of([&] { (void)load_run_config("", keys); });
                  const std::string planner = planner_only(cfg, l);
                  const std::string where = fmt::format("{}", fmt::join(layout_keys(l), " "));
                  if (loader.empty()) {
                    EXPECT_EQ(planner, "") << where;
                    ++runs;
                  } else {
                    EXPECT_EQ(planner, "planner only: " + loader) << where;
                    ++refused;
                  }
                }
  // Both kinds are in the grid: tensor parallelism and pipelines run, their refusals are met.
  EXPECT_GT(runs, 50);
  EXPECT_GT(refused, 50);
}

// The keys the trainer has none of are the planner's own, named as such.
TEST(PlanTrainerRuns, WhatTheTrainerHasNoKeyForIsNamed) {
  const RunConfig cfg;
  Layout l{.procs = 4, .ep = 1};
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  // Expert tensor parallelism runs where the trainer's validation lets it
  // (validate_expert_tensor_parallel); in stages it is refused by that validation's name.
  l.etp = 2;
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  RunConfig accum = cfg;
  accum.train.grad_accum = 2;  // a micro-batch for each stage
  Layout staged{.procs = 8, .ep = 1, .pp = 2, .etp = 2};
  EXPECT_NE(planner_only(accum, staged).find("dist.etp = 2 with dist.pp = 2"), std::string::npos)
      << planner_only(accum, staged);
  l.a2a_dedup = true;
  EXPECT_EQ(planner_only(cfg, l),
            "planner only: moetrain train has no deduplicated (DeepEP) all-to-all yet");
}
