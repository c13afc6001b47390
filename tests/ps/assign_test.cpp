// Row assignment measured end to end: two workers, one slowed 2× (`--slowdown 1=2`: it sleeps as
// long again as each step's compute). Under `--assign capability` the scheduler splits the global
// batch by the workers' reported throughput, so once the assignment settles the slow worker
// computes about half the rows of the fast one; under `--assign uniform` both get the same rows
// whatever their speed. Rows are read from each worker's own metrics file
// (RUN_DIR/metrics/worker_I.jsonl, one line per step with the rows it computed). At every step
// the two workers' rows add up to the global batch: a new split applies from one clock on for
// both (a worker that switched a clock before the other would leave rows out or count them twice).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "io/metrics.h"
#include "ps/process.h"  // tests/ps/process.h
#include "support/corpus.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int kBatch = 24;  // per worker: 48 rows a step, split between the two

// Rows per step of each worker, in step order.
std::vector<std::vector<int64_t>> run_rows(const TempDir& tmp, const std::string& name,
                                           const std::string& assign, int steps) {
  write_corpus(tmp / "data", 60000);
  std::vector<std::string> args = {"ps",
                                   "launch",
                                   "--timeout",
                                   "150",
                                   "--servers",
                                   "1",
                                   "--workers",
                                   "2",
                                   "--assign",
                                   assign,
                                   "--slowdown",
                                   "1=2",
                                   "--heartbeat-interval",
                                   "0.1",
                                   // Several re-splits within a run of a few seconds, however
                                   // fast the machine runs it.
                                   "--rebalance-every",
                                   "0.25",
                                   "--",
                                   "train"};
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp / "data", tmp / name, steps, kBatch)))
    args.push_back(s);
  Process p(args, tmp / (name + ".log"));
  const int code = p.wait(180);
  EXPECT_EQ(code, 0) << name << ":\n" << p.output();
  std::vector<std::vector<int64_t>> rows(2);
  if (code != 0) return rows;
  const auto roles = read_role_metrics(tmp / name);
  for (int w = 0; w < 2; ++w) {
    const std::string role = "worker_" + std::to_string(w);
    EXPECT_TRUE(roles.contains(role)) << role;
    if (!roles.contains(role)) continue;
    for (const auto& j : roles.at(role)) rows[w].push_back(j.at("rows").get<int64_t>());
  }
  return rows;
}

double mean_of_last(const std::vector<int64_t>& v, std::size_t n) {
  double s = 0;
  for (std::size_t i = v.size() - n; i < v.size(); ++i) s += static_cast<double>(v[i]);
  return s / static_cast<double>(n);
}

TEST(PsAssign, CapabilityGivesTheSlowWorkerAboutHalfTheRows) {
  TempDir tmp("ps_assign_capability");
  const int steps = 300;
  auto rows = run_rows(tmp, "capability", "capability", steps);
  ASSERT_EQ(rows[0].size(), static_cast<std::size_t>(steps));
  ASSERT_EQ(rows[1].size(), static_cast<std::size_t>(steps));
  std::string trace;
  for (int t = 0; t < steps; ++t)
    trace += std::to_string(rows[0][t]) + "/" + std::to_string(rows[1][t]) + " ";
  int bad = 0;
  for (int t = 0; t < steps; ++t) bad += rows[0][t] + rows[1][t] != 2 * kBatch;
  EXPECT_EQ(bad, 0) << "steps whose rows are not the global batch of " << 2 * kBatch
                    << "; rows per step (fast/slow): " << trace;
  // Settled: the last quarter of the run (the scheduler rebalances at most every 0.25 s, from
  // the throughputs in the heartbeats; the run takes 2 to 5 s).
  const std::size_t tail = steps / 4;
  const double fast = mean_of_last(rows[0], tail), slow = mean_of_last(rows[1], tail);
  std::printf("capability: settled rows fast %.2f, slow %.2f, ratio %.3f\n", fast, slow,
              slow / fast);
  // The split follows measured throughput, which on a shared machine is noisy and carries each
  // step's fixed cost (fewer rows, a lower rate): measured 0.27 to 0.60 over runs, median about
  // 0.5. The band tells it from no rebalancing (1) and from starving the slow worker.
  EXPECT_GE(slow / fast, 0.25) << "slow " << slow << ", fast " << fast;
  EXPECT_LE(slow / fast, 0.75) << "slow " << slow << ", fast " << fast;
}

TEST(PsAssign, UniformGivesEqualRowsWhateverTheSpeed) {
  TempDir tmp("ps_assign_uniform");
  const int steps = 30;
  auto rows = run_rows(tmp, "uniform", "uniform", steps);
  for (int w = 0; w < 2; ++w) {
    ASSERT_EQ(rows[w].size(), static_cast<std::size_t>(steps)) << "worker " << w;
    for (int t = 0; t < steps; ++t)
      EXPECT_EQ(rows[w][t], kBatch) << "worker " << w << " step " << t;
  }
}

}  // namespace
