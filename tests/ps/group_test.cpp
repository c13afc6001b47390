// Worker groups: `mpiexec -n 2 moetrain ps worker --ep 2` as real processes (real MPI between the
// group's ranks, real ZeroMQ sockets to the scheduler and the servers on loopback).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "io/metrics.h"
#include "io/report.h"
#include "ps/group_job.h"  // tests/ps/group_job.h
#include "ps/process.h"  // tests/ps/process.h
#include "support/corpus.h"
#include "support/report_defaults.h"
#include "support/temp_dir.h"
#include "train/lm_checkpoint.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

std::map<int64_t, double> losses(const fs::path& run) {
  std::map<int64_t, double> out;
  for (const auto& j : read_metrics(run))
    if (j.contains("loss")) out[j["step"].get<int64_t>()] = j["loss"].get<double>();
  return out;
}

// The group job against the single-process run with the same global batch (groups × ep × batch
// rows). Not bitwise: an expert's gradient sums its tokens from both ranks inside one grouped
// GEMM where the reference sums them inside its own, and the dense gradients are summed per rank
// first (the group's reduce-scatter in rank order) where the reference's GEMMs sum over every row
// at once. Both are f32 sums of the same terms in another order, each off by a few ulps (relative
// 1e-7); over the steps' AdamW updates that stays within 1e-5 relative, the bound the ungrouped
// sync job is held to (ps.PsJob.SyncEqualsSingleProcess), measured far below it.
void expect_follows_single_process(GroupJob& job, int n_groups, int ep, int steps, int batch) {
  ASSERT_EQ(job.wait(150), 0) << job.logs();
  RunConfig ref = load_run_config(
      "", tiny_ps_overrides(job.dir / "data", job.dir / "ref", steps, n_groups * ep * batch));
  std::vector<float> ref_params;
  {
    Trainer t(ref, false);
    t.run();
    ref_params = t.params();
  }
  auto a = losses(job.run), b = losses(job.dir / "ref");
  ASSERT_EQ(a.size(), static_cast<std::size_t>(steps)) << job.logs();
  for (auto [step, loss] : b) {
    ASSERT_TRUE(a.count(step)) << step;
    EXPECT_LE(std::fabs(a[step] - loss), 1e-5 * std::fabs(loss)) << "step " << step;
  }
  LoadedModel m = load_model(job.run);
  EXPECT_EQ(m.step, steps);
  ASSERT_EQ(m.params.size(), ref_params.size());
  const double distance = relative_l2(m.params, ref_params);
  EXPECT_LE(distance, 1e-5);
  std::cout << "relative L2 distance to the single-process run: " << distance << "\n";
}

std::vector<nlohmann::json> worker_stats(const fs::path& run) {
  std::vector<nlohmann::json> out;
  for (const auto& f : fs::directory_iterator(run / "ps"))
    if (f.path().filename().string().rfind("worker_node", 0) == 0) out.push_back(read_json(f));
  return out;
}

}  // namespace

TEST(PsGroup, OneGroupOfTwoFollowsTheSingleProcessRun) {
  TempDir tmp("ps_group1");
  const int steps = 10, batch = 4;
  GroupJob job(tmp.path(), "run", 1, 2, steps, batch, {});
  expect_follows_single_process(job, 1, 2, steps, batch);
  // Each rank holds two of the four experts.
  for (const auto& w : worker_stats(job.run)) {
    ASSERT_TRUE(w.contains("group")) << w.dump();
    EXPECT_EQ(w["group"]["expert_count"], 2);
    EXPECT_EQ(w["group"]["expert_first"], 2 * w["group"]["rank"].get<int>());
  }
}

// One group of EP 2 against `mpiexec -n 2 moetrain train` with dist.ep = 2 over the same global
// batch: the same code sums in the same order. Each rank reads the same rows and routes them
// through the same all-to-all; an expert's gradient is summed by its owner over the same tokens;
// a dense gradient is g0 + g1, the ranks' sums in rank order (the group's reduce-scatter here,
// the gradient reduction's reduce-scatter there, both core/comm.h), which the server adds to zero
// (exact) from the one push that carries the key; and the server's update is the engine's
// optimizer step on the same values. So the final parameters are bitwise equal.
TEST(PsGroup, OneGroupEndsBitwiseWhereTheCollectiveRunEnds) {
  TempDir tmp("ps_group_bitwise");
  const int steps = 6, batch = 4;
  GroupJob job(tmp.path(), "run", 1, 2, steps, batch, {});
  ASSERT_EQ(job.wait(150), 0) << job.logs();
  const CollectiveRun mpi = collective_run(tmp.path(), "mpi", 2, steps, batch, {});
  ASSERT_EQ(mpi.code, 0) << mpi.output;
  const std::vector<float> a = load_model(job.run).params, b = load_model(tmp / "mpi").params;
  ASSERT_EQ(a.size(), b.size());
  int64_t differ = 0;
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    differ += a[i] != b[i];
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  EXPECT_EQ(differ, 0) << "of " << a.size() << " parameters differ (largest difference " << worst
                       << ")";
}

// Each step's `key` (a number) from a run's metrics.jsonl.
std::map<int64_t, double> per_step(const fs::path& run, const char* key) {
  std::map<int64_t, double> out;
  for (const auto& j : read_metrics(run))
    if (j.contains(key) && j.contains("step")) out[j["step"].get<int64_t>()] = j[key].get<double>();
  return out;
}

// The MoE machinery whose figures travel on the keys past the parameters, in a group: router-bias
// balancing (each rank's expert loads of its tokens), sparse expert gradients and utilisation
// reweighting (each rank's tokens per expert of each micro-batch). The group's reduce-scatter
// sums those integers over its ranks (exact in f32), the server steps the biases and takes the
// mask and the loads with the trainers' code, and the biases come back with the dense values.
// Against `mpiexec -n 2 moetrain train` with dist.ep = 2 and the same settings, where the same
// integers are summed over the ranks (int64) and the same rules run: the biases, every step's
// frozen experts and the final parameters bitwise, as OneGroupEndsBitwise argues for the rest.
// One server, and no clip: the collective run's norm sums per-rank parts, a single server's its
// whole range, in another order. 8 experts, top-1, two micro-batches of which an expert must be
// reached in both (min_accum_fraction = 1): experts freeze at most steps.
TEST(PsGroup, BiasBalancingSparseExpertsAndUtilisationEndBitwiseWhereTheCollectiveRunEnds) {
  TempDir tmp("ps_group_moe");
  const int steps = 6, batch = 2;
  const std::vector<std::string> moe = {
      "model.n_experts=8",          "model.top_k=1",
      "model.router=sigmoid_bias",  "model.bias_update_rate=0.01",
      "train.grad_accum=2",         "grad.sparse_experts=true",
      "grad.min_accum_fraction=1",  "grad.expert_reweight=utilisation",
      "grad.util_low=0.9",          "grad.util_high=1.1"};
  GroupJob job(tmp.path(), "run", 1, 2, steps, batch, moe, 1);
  ASSERT_EQ(job.wait(150), 0) << job.logs();
  const CollectiveRun mpi = collective_run(tmp.path(), "mpi", 2, steps, batch, moe);
  ASSERT_EQ(mpi.code, 0) << mpi.output;

  const std::map<int64_t, double> frozen = per_step(tmp / "mpi", "experts_frozen");
  ASSERT_EQ(frozen.size(), static_cast<std::size_t>(steps));
  double total = 0;
  for (auto [step, f] : frozen) total += f;
  EXPECT_GT(total, 0) << "the configuration should freeze experts";
  EXPECT_EQ(per_step(job.run, "experts_frozen"), frozen);

  LoadedModel a = load_model(job.run), b = load_model(tmp / "mpi");
  ASSERT_EQ(a.params.size(), b.params.size());
  EXPECT_EQ(values_differing(a.params, b.params), 0)
      << "of " << a.params.size() << " parameters differ";
  const std::vector<MoeLayer*> la = a.model->moe_layers(), lb = b.model->moe_layers();
  ASSERT_EQ(la.size(), lb.size());
  bool moved = false;
  for (std::size_t m = 0; m < la.size(); ++m)
    for (int64_t e = 0; e < 8; ++e) {
      EXPECT_EQ(la[m]->router_bias()[e], lb[m]->router_bias()[e]) << "layer " << m << " expert " << e;
      moved = moved || lb[m]->router_bias()[e] != 0.0f;
    }
  EXPECT_TRUE(moved) << "the biases should have moved";
  std::printf("%.0f experts frozen over %d steps; biases and parameters bitwise\n", total, steps);
}

// Hot-expert replication in a group (placement.spare_slots = 1): the group's ranks re-plan from
// the clock's loads summed over them, once the pull brought the owners' new weights, which then
// refresh the replicas; a replica's gradient goes to its owner during backward (the step engine's
// ExpertPlacement, the same code). Against `mpiexec -n 2 moetrain train` with dist.ep = 2 and the
// same placement, whose world is the group: the same plans from the same integer loads, the same
// replica reductions, so the parameters end bitwise equal. Replication changes the order in which
// an expert's gradient is summed, so a group that ignored the placement would not.
TEST(PsGroup, HotExpertReplicasEndBitwiseWhereTheCollectiveRunEnds) {
  TempDir tmp("ps_group_placement");
  const int steps = 6, batch = 4;
  const std::vector<std::string> placement = {"model.top_k=2", "placement.spare_slots=1",
                                              "placement.every=2", "placement.decay=0.5"};
  GroupJob job(tmp.path(), "run", 1, 2, steps, batch, placement, 1);
  ASSERT_EQ(job.wait(150), 0) << job.logs();
  const CollectiveRun mpi = collective_run(tmp.path(), "mpi", 2, steps, batch, placement);
  ASSERT_EQ(mpi.code, 0) << mpi.output;
  double most = 0;
  for (const auto& j : read_metrics(tmp / "mpi"))
    if (j.contains("replicas_per_expert"))
      for (double r : j["replicas_per_expert"].get<std::vector<double>>()) most = std::max(most, r);
  EXPECT_GT(most, 1.0) << "the collective run placed no replica";
  const std::vector<float> a = load_model(job.run).params, b = load_model(tmp / "mpi").params;
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(values_differing(a, b), 0) << "of " << a.size() << " parameters differ";
}

// Two groups of a sync job place their replicas from the job's loads, which the scheduler's
// round sums over every rank of every group, as the 4 processes of `train` with dist.ep = 2 and
// the same global batch plan from their summed loads: every re-plan (placement.every = 1, decay
// 0: each from the last clock's loads alone) moves the same replicas in the collective run, in
// the scheduler's record of its decisions and in each group. Planned from a group's own loads
// (half the tokens), group 0 moved a replica a clock late and the test failed. The parameters follow within the group jobs' bound (the replicas only
// move where an expert's rows are computed; the sums' order differs).
TEST(PsGroup, TwoGroupsPlaceReplicasFromTheJobsLoadsAsTheCollectiveRun) {
  TempDir tmp("ps_group_placement_two");
  const int steps = 8, batch = 4;
  const std::vector<std::string> placement = {"model.top_k=2", "placement.spare_slots=1",
                                              "placement.every=1", "placement.decay=0"};
  GroupJob job(tmp.path(), "run", 2, 2, steps, batch, placement, 1);
  ASSERT_EQ(job.wait(150), 0) << job.logs();
  const CollectiveRun mpi = collective_run(tmp.path(), "mpi", 2, steps, batch, placement, 4);
  ASSERT_EQ(mpi.code, 0) << mpi.output;
  // "step S: placement layer L: expert e rank a -> rank b; ..." (ExpertPlacement's log line).
  auto moves_in = [](const std::string& log) {
    std::vector<std::string> out;
    std::istringstream in(log);
    for (std::string line; std::getline(in, line);)
      if (auto at = line.find(": placement layer "); at != std::string::npos) {
        const auto step = line.rfind("step ", at);
        if (step != std::string::npos) out.push_back(line.substr(step));
      }
    return out;
  };
  std::vector<std::string> expected = moves_in(mpi.output);
  // Each of the 4 ranks logs its moves: rank 0's are the first of each step.
  std::sort(expected.begin(), expected.end());
  expected.erase(std::unique(expected.begin(), expected.end()), expected.end());
  ASSERT_FALSE(expected.empty()) << "the collective run moved no replica\n" << mpi.output;
  std::vector<std::string> decided;
  const auto roles = read_role_metrics(job.run);
  ASSERT_TRUE(roles.contains("scheduler"));
  for (const auto& j : roles.at("scheduler"))
    if (j.value("decision", "") == "placement")
      decided.push_back(fmt::format("step {}: placement {}", j.at("clock").get<int64_t>(),
                                    j.at("moves").get<std::string>()));
  std::sort(decided.begin(), decided.end());
  EXPECT_EQ(decided, expected) << "the scheduler's decisions";
  // The report lists them among the scheduler's decisions, with the hot experts.
  const std::string html = render_report(job.run, report_defaults());
  const auto decisions = html.find("<section id=\"decisions\"");
  ASSERT_NE(decisions, std::string::npos) << "no decisions section";
  const std::string sec = html.substr(decisions, html.find("</section>", decisions) - decisions);
  EXPECT_NE(sec.find("<td>placement</td>"), std::string::npos) << sec;
  EXPECT_NE(sec.find("hot experts"), std::string::npos) << sec;
  for (std::size_t g = 0; g < job.groups.size(); ++g) {
    std::vector<std::string> placed = moves_in(job.groups[g]->output());
    std::sort(placed.begin(), placed.end());
    placed.erase(std::unique(placed.begin(), placed.end()), placed.end());
    EXPECT_EQ(placed, expected) << "group " << g;
  }
  const std::vector<float> a = load_model(job.run).params, b = load_model(tmp / "mpi").params;
  ASSERT_EQ(a.size(), b.size());
  EXPECT_LT(relative_l2(a, b), 1e-5);
}

// Outside sync a group's two pushes of a clock make one update. One group under async is then
// one worker whose every clock is an update of all its parts, summed in rank order, at the
// schedule's step of that clock: bitwise the sync group job's parameters, which
// OneGroupEndsBitwiseWhereTheCollectiveRunEnds holds to `mpiexec -n 2 moetrain train`. Applied
// part by part (each rank's push an update of its own) the optimizer would step every key twice a
// clock, and with a rank's pull answered before its group's update 40,861 of the 47,520
// parameters ended elsewhere. Two groups under ssp (staleness 1): every update is a group's two
// pushes, each group's clocks are all applied, and the loss comes down.
TEST(PsGroup, AsyncAndSspApplyAGroupsPushesOfAClockAsOneUpdate) {
  TempDir tmp("ps_group_async");
  const int steps = 6, batch = 4;
  GroupJob sync(tmp.path(), "sync", 1, 2, steps, batch, {}, 1);
  ASSERT_EQ(sync.wait(150), 0) << sync.logs();
  GroupJob async(tmp.path(), "async", 1, 2, steps, batch, {}, 1, {"--consistency", "async"});
  ASSERT_EQ(async.wait(150), 0) << async.logs();
  const std::vector<float> a = load_model(async.run).params, b = load_model(sync.run).params;
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(values_differing(a, b), 0)
      << "of " << a.size() << " parameters differ from the sync group job's";

  const int ssp_steps = 8;
  GroupJob ssp(tmp.path(), "ssp", 2, 2, ssp_steps, 2, {}, 2,
               {"--consistency", "ssp", "--staleness", "1"});
  ASSERT_EQ(ssp.wait(150), 0) << ssp.logs();
  int updates = 0;
  double first = 0, last = 0;
  for (const auto& j : read_metrics(ssp.run)) {
    if (!j.contains("pushes")) continue;
    EXPECT_EQ(j["pushes"].get<int64_t>(), 2) << j.dump();
    if (updates == 0) first = j["loss"].get<double>();
    last = j["loss"].get<double>();
    ++updates;
  }
  EXPECT_EQ(updates, 2 * ssp_steps);
  EXPECT_LT(last, first);
}

// Quorum counts groups: a clock applies once q whole groups' parts are in, with every whole
// group's parts and none of a group still missing one. With q = 2 of 2 groups every clock waits
// for both, in worker-index order, at the same schedule step: bitwise the sync job. With q = 1
// each update holds one or both groups whole: 2 or 4 pushes (one per rank) and 4 or 8 rows (2
// ranks of 2 rows each), never a part of a group; every clock is applied once and the job ends.
TEST(PsGroup, QuorumAppliesWholeGroupsOnly) {
  TempDir tmp("ps_group_quorum");
  const int steps = 6, batch = 2;
  GroupJob sync(tmp.path(), "sync", 2, 2, steps, batch, {}, 1);
  ASSERT_EQ(sync.wait(150), 0) << sync.logs();
  GroupJob all(tmp.path(), "q2", 2, 2, steps, batch, {}, 1, {"--consistency", "quorum", "--quorum", "2"});
  ASSERT_EQ(all.wait(150), 0) << all.logs();
  const std::vector<float> a = load_model(all.run).params, b = load_model(sync.run).params;
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(values_differing(a, b), 0)
      << "of " << a.size() << " parameters differ from the sync job's";

  GroupJob one(tmp.path(), "q1", 2, 2, steps, batch, {}, 1, {"--consistency", "quorum", "--quorum", "1"});
  ASSERT_EQ(one.wait(150), 0) << one.logs();
  int updates = 0, single = 0;
  for (const auto& j : read_metrics(one.run)) {
    if (!j.contains("pushes")) continue;
    const int64_t pushes = j["pushes"].get<int64_t>(), rows = j["rows"].get<int64_t>();
    EXPECT_TRUE(pushes == 2 || pushes == 4) << j.dump();
    EXPECT_EQ(rows, pushes * batch) << j.dump();
    single += pushes == 2;
    ++updates;
  }
  EXPECT_EQ(updates, steps);
  EXPECT_EQ(load_model(one.run).step, steps);
  std::printf("quorum 1 of 2 groups: %d of %d updates held one group\n", single, updates);

  // The quorum counts groups: 3 of 2 groups (4 workers) is refused once the workers registered.
  GroupJob three(tmp.path(), "q3", 2, 2, steps, batch, {}, 1,
                 {"--consistency", "quorum", "--quorum", "3"});
  EXPECT_NE(three.wait(60), 0);
  EXPECT_NE(three.logs().find("--quorum 3: the quorum counts worker groups"), std::string::npos)
      << three.logs();
  EXPECT_FALSE(fs::exists(three.run / "checkpoints" / "step_00000001"));
}

// average with a group: after H local steps each rank pushes its keys' parameters; the group's
// local steps are `train`'s steps with dist.ep = 2 over the same processes (the same rows,
// exchange, rank-ordered dense sums, check and AdamW step, its schedule over T·H steps), and the
// servers' mean of one group (share 1, each key pushed by one rank, the others' zeros) is the
// group's parameters exactly. So one group of 2 after T clocks of H ends bitwise where `mpiexec
// -n 2 moetrain train` with dist.ep = 2 ends after T·H steps: the same code sums in the same
// order (the dense sum of two ranks is g0 + g1 on both sides, and AdamW is elementwise).
TEST(PsGroup, AverageOfOneGroupEndsWhereTheCollectiveRunEnds) {
  TempDir tmp("ps_group_average");
  const int H = 2, T = 3, batch = 4;
  GroupJob job(tmp.path(), "run", 1, 2, T, batch, {}, 1,
               {"--consistency", "average", "--local-steps", std::to_string(H)});
  ASSERT_EQ(job.wait(150), 0) << job.logs();
  const CollectiveRun mpi = collective_run(tmp.path(), "mpi", 2, T * H, batch, {});
  ASSERT_EQ(mpi.code, 0) << mpi.output;
  const std::vector<float> a = load_model(job.run).params, b = load_model(tmp / "mpi").params;
  ASSERT_EQ(a.size(), b.size());
  const double d = relative_l2(a, b);
  std::printf("average, one group of 2: %lld of %zu parameters differ, relative L2 %.3g\n",
              static_cast<long long>(values_differing(a, b)), a.size(), d);
  EXPECT_EQ(values_differing(a, b), 0) << "relative L2 " << d;
  // With a clip the group's norm is its ranks' parts summed over the group, and `train`'s its
  // ranks' reduced shards: the same squares summed in another blocking, a few ulps apart, so the
  // clip factors differ in their last bits (relative 1e-7 a step); over 6 AdamW steps that stays
  // within 1e-5 relative, the bound of the other group jobs against a reference (measured 0:
  // the double sums' difference does not reach the float factor here).
  const std::vector<std::string> clip = {"optim.grad_clip=0.05"};
  GroupJob clipped(tmp.path(), "clip", 1, 2, T, batch, clip, 1,
                   {"--consistency", "average", "--local-steps", std::to_string(H)});
  ASSERT_EQ(clipped.wait(150), 0) << clipped.logs();
  const CollectiveRun mpi_clip = collective_run(tmp.path(), "mpi_clip", 2, T * H, batch, clip);
  ASSERT_EQ(mpi_clip.code, 0) << mpi_clip.output;
  const std::vector<float> c = load_model(clipped.run).params,
                           e = load_model(tmp / "mpi_clip").params;
  const double dc = relative_l2(c, e);
  std::printf("clipped: relative L2 %.3g (to the unclipped run %.3g)\n", dc, relative_l2(c, b));
  EXPECT_LE(dc, 1e-5);
  EXPECT_GT(relative_l2(c, b), 1e-4) << "the clip did not bite";
  // Two groups of 2: every clock is one update of the four ranks' pushes, and the job ends.
  GroupJob two(tmp.path(), "two", 2, 2, T, 2, {}, 1,
               {"--consistency", "average", "--local-steps", std::to_string(H)});
  ASSERT_EQ(two.wait(150), 0) << two.logs();
  const auto s = read_json(two.run / "ps" / "server_0.json");
  EXPECT_EQ(s["updates"].get<int64_t>(), T);
  EXPECT_EQ(s["pushes"].get<int64_t>(), 4 * T);
  EXPECT_EQ(load_model(two.run).step, T);
}

TEST(PsGroup, TwoGroupsOfTwoFollowTheSingleProcessRun) {
  TempDir tmp("ps_group2");
  const int steps = 8, batch = 2;
  GroupJob job(tmp.path(), "run", 2, 2, steps, batch, {});
  expect_follows_single_process(job, 2, 2, steps, batch);
  EXPECT_EQ(worker_stats(job.run).size(), 4u);
}

// --assign capability over worker groups: group 1's ranks run at --slowdown 3, so the scheduler,
// which weighs a group by its slowest rank's rate times its ranks, moves rows to group 0. Every
// re-split applies from one clock for all four ranks: each step's rows still add up to the global
// batch, a group's ranks share its rows evenly, and since the global batch is the same rows
// whichever rank computes them, the job follows the single-process run within the bound of the
// uniform group jobs (1e-5 relative; only the order of the f32 sums moves with the split).
TEST(PsGroup, CapabilityMovesRowsToTheFasterGroupAtOneClock) {
  TempDir tmp("ps_group_capability");
  const int steps = 60, batch = 8, global = 2 * 2 * batch;
  // A re-split at most every 0.5 s (a heartbeat's measurement), so that the rows move within the
  // job on a fast machine too.
  GroupJob job(tmp.path(), "run", 2, 2, steps, batch, {}, 1,
               {"--assign", "capability", "--rebalance-every", "0.5"}, "5", 1.0,
               {1.0, 3.0});
  expect_follows_single_process(job, 2, 2, steps, batch);
  // Rows per worker and step, from each worker's own metrics (one line per step it computed).
  const auto roles = read_role_metrics(job.run);
  std::vector<std::vector<int64_t>> rows(4);
  for (int w = 0; w < 4; ++w) {
    const std::string role = "worker_" + std::to_string(w);
    ASSERT_TRUE(roles.contains(role)) << role;
    for (const auto& j : roles.at(role)) rows[w].push_back(j.at("rows").get<int64_t>());
    ASSERT_EQ(rows[w].size(), static_cast<std::size_t>(steps)) << role << "\n" << job.logs();
  }
  int moved = 0;
  for (int t = 0; t < steps; ++t) {
    EXPECT_EQ(rows[0][t] + rows[1][t] + rows[2][t] + rows[3][t], global) << "step " << t;
    EXPECT_LE(std::abs(rows[0][t] - rows[1][t]), 1) << "group 0, step " << t;
    EXPECT_LE(std::abs(rows[2][t] - rows[3][t]), 1) << "group 1, step " << t;
    moved += rows[0][t] + rows[1][t] > rows[2][t] + rows[3][t];
  }
  EXPECT_GT(moved, 0) << "group 0 never got more rows than the slow group 1";
  EXPECT_GT(rows[0].back() + rows[1].back(), rows[2].back() + rows[3].back());
  // Each re-split is a decision in metrics/scheduler.jsonl: its clock, the groups' measured
  // throughputs and rows, its cause; the rows of the last one are those of the last step.
  std::vector<nlohmann::json> decisions;
  for (const auto& j : roles.at("scheduler"))
    if (j.value("decision", "") == "assign" && j.value("cause", "") == "measured throughput")
      decisions.push_back(j);
  ASSERT_FALSE(decisions.empty()) << job.logs();
  const nlohmann::json& last = decisions.back();
  ASSERT_EQ(last.at("groups").size(), 2u);
  EXPECT_GE(last.at("clock").get<int64_t>(), 1);
  EXPECT_LE(last.at("clock").get<int64_t>(), steps);
  const auto& g0 = last.at("groups")[0];
  const auto& g1 = last.at("groups")[1];
  EXPECT_EQ(g0.at("workers"), (nlohmann::json{0, 1}));
  EXPECT_GT(g0.at("throughput").get<double>(), g1.at("throughput").get<double>());
  if (last.at("clock").get<int64_t>() < steps) {
    EXPECT_EQ(g0.at("rows").get<int64_t>(), rows[0].back() + rows[1].back());
    EXPECT_EQ(g1.at("rows").get<int64_t>(), rows[2].back() + rows[3].back());
  }
  std::cout << "rows per step (group 0 / group 1):";
  for (int t = 0; t < steps; ++t)
    std::cout << " " << rows[0][t] + rows[1][t] << "/" << rows[2][t] + rows[3][t];
  std::cout << "\n" << decisions.size() << " re-splits, the last from clock "
            << last.at("clock") << "\n";
}

// With many experts a group rank's pushes and pulls are its experts and its share of the dense
// keys: E = 16, top-2, EP 2 halves the expert keys and the dense keys alike, so each rank's push
// bytes are about half of a full replica's (dense_push_bytes: every key in f32, what a replica
// worker with --dense-push sends; with 128 tokens × top-2 over 16 experts a replica's sparse push
// leaves out almost nothing). 0.6 leaves room for headers and range lists.
TEST(PsGroup, AGroupRankPushesAndPullsItsShareOfTheKeys) {
  TempDir tmp("ps_group_bytes");
  GroupJob job(tmp.path(), "run", 1, 2, 4, 4, {"model.n_experts=16"}, 1);
  ASSERT_EQ(job.wait(150), 0) << job.logs();
  const auto stats = worker_stats(job.run);
  ASSERT_EQ(stats.size(), 2u);
  for (const auto& w : stats) {
    const double push = w["push_bytes"].get<double>(), dense = w["dense_push_bytes"].get<double>();
    std::cout << "rank " << w["group"]["rank"] << ": pushed " << push << " bytes of " << dense
              << " (" << push / dense << "), pulled " << w["pull_bytes"] << " of "
              << w["dense_pull_bytes"] << "\n";
    EXPECT_LE(push, 0.6 * dense) << w.dump();
    // The figures are written before the lead's final read of every key for the checkpoint.
    EXPECT_LE(w["pull_bytes"].get<double>(), 0.6 * w["dense_pull_bytes"].get<double>())
        << w.dump();
  }
  EXPECT_EQ(load_model(job.run).step, 4);
}

// Refusals: each names what is wrong, and the worker writes nothing.
TEST(PsGroup, RefusesGroupsItCannotRun) {
  TempDir tmp("ps_group_refused");
  // A group size that is not the MPI world's, before anything registers.
  {
    std::vector<std::string> launcher = kMpiexec;
    launcher.push_back("2");
    Process p({"ps", "worker", "--insecure", "--scheduler", "tcp://127.0.0.1:9", "--ep", "3"},
              tmp / "world.log", launcher);
    EXPECT_NE(p.wait(60), 0);
    EXPECT_NE(p.output().find("--ep 3 in an MPI world of 2 processes"), std::string::npos)
        << p.output();
    Process q({"ps", "worker", "--insecure", "--scheduler", "tcp://127.0.0.1:9", "--ep", "2"},
              tmp / "alone.log");
    EXPECT_NE(q.wait(60), 0);
    EXPECT_NE(q.output().find("--ep 2 in an MPI world of 1 process"), std::string::npos)
        << q.output();
  }
  // --ep that does not divide the experts, once the scheduler's setup names them.
  {
    GroupJob job(tmp.path(), "experts", 1, 2, 4, 2, {"model.n_experts=3"}, 1);
    EXPECT_NE(job.groups[0]->wait(60), 0);
    EXPECT_NE(job.groups[0]->output().find("--ep 2: model.n_experts = 3 is not a multiple"),
              std::string::npos)
        << job.logs();
    // The scheduler's own files are there; nothing of a worker's.
    for (const auto& f : fs::recursive_directory_iterator(job.run))
      EXPECT_EQ(f.path().filename().string().find("worker"), std::string::npos)
          << f.path() << " was written";
    EXPECT_FALSE(fs::exists(job.run / "checkpoints")) << "a checkpoint was written";
  }
  // Hot-expert replicas under average: the local steps move the owners between the pulls that
  // refresh the replicas.
  {
    GroupJob job(tmp.path(), "average", 1, 2, 4, 2, {"placement.spare_slots=1"}, 1,
                 {"--consistency", "average", "--local-steps", "2"});
    EXPECT_NE(job.groups[0]->wait(60), 0);
    EXPECT_NE(job.groups[0]->output().find(
                  "placement.spare_slots = 1 with --ep 2 and --consistency average:"),
              std::string::npos)
        << job.logs();
  }
  // A [dist] setting given with --set: the layout is the worker's flags, never [dist].
  {
    write_corpus(tmp / "data", 60000);
    Process p({"ps", "launch", "--", "train", "--set", "dist.a2a_chunks=2", "--set",
               "train.run_dir=" + (tmp / "dist").string()},
              tmp / "dist.log");
    EXPECT_NE(p.wait(60), 0);
    EXPECT_NE(p.output().find("dist.a2a_chunks = 2: parameter-server mode"), std::string::npos)
        << p.output();
    EXPECT_FALSE(fs::exists(tmp / "dist")) << "something was written";
  }
}

// `ps launch --group-size 2` starts each group with mpirun; the job is the one of
// OneGroupOfTwoFollowsTheSingleProcessRun, so it ends with the same final parameters as a group
// started by hand (the same processes, rows and sums: sync is deterministic).
TEST(PsGroup, LaunchStartsGroupsWithMpirun) {
  TempDir tmp("ps_group_launch");
  const int steps = 4, batch = 2;
  write_corpus(tmp / "data", 60000);
  std::vector<std::string> args = {"ps", "launch", "--timeout", "120", "--insecure", "--servers",
                                   "2", "--workers", "2", "--group-size", "2",
                                   "--mpi-arg=--allow-run-as-root", "--mpi-arg=--oversubscribe",
                                   "--", "train"};
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp / "data", tmp / "run", steps, batch)))
    args.push_back(s);
  Process p(args, tmp / "launch.log");
  ASSERT_EQ(p.wait(150), 0) << p.output();
  GroupJob by_hand(tmp.path(), "hand", 1, 2, steps, batch, {});
  ASSERT_EQ(by_hand.wait(150), 0) << by_hand.logs();
  const std::vector<float> a = load_model(tmp / "run").params, b = load_model(by_hand.run).params;
  ASSERT_EQ(a.size(), b.size());
  EXPECT_TRUE(a == b) << "a launched group ends elsewhere than one started by hand";
  const auto launched = read_json(tmp / "run" / "ps" / "launch.json");
  EXPECT_NE(launched.dump().find("worker group 0"), std::string::npos) << launched.dump();

  // A quorum of more groups than --workers / --group-size makes is refused before anything runs.
  std::vector<std::string> bad = {"ps", "launch", "--timeout", "60", "--insecure", "--servers",
                                  "1", "--workers", "4", "--group-size", "2", "--consistency",
                                  "quorum", "--quorum", "3", "--", "train"};
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp / "data", tmp / "bad", steps, batch)))
    bad.push_back(s);
  Process refused(bad, tmp / "bad.log");
  EXPECT_NE(refused.wait(60), 0);
  EXPECT_NE(refused.output().find("--quorum 3 with --group-size 2: the quorum counts worker "
                                  "groups, and --workers 4 makes 2; allowed are 1..2"),
            std::string::npos)
      << refused.output();
  EXPECT_FALSE(fs::exists(tmp / "bad"));
}
