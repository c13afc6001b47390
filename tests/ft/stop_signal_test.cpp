// SIGINT/SIGTERM end a run after the current step with a checkpoint at that step (exit 130/143),
// on every rank at the same step, and `--resume` continues from it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <optional>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ft/ft_support.h"
#include "support/temp_dir.h"

namespace moetrain::testing {
namespace {

namespace fs = std::filesystem;

int metrics_lines(const fs::path& run) {
  std::ifstream in(run / "metrics.jsonl");
  int n = 0;
  for (std::string line; std::getline(in, line);) n += line.find("\"loss\"") != std::string::npos;
  return n;
}

// The checkpoints directory's step_* entries, and whether any .tmp_ one is left.
std::vector<std::string> checkpoints(const fs::path& run, bool& tmp_left) {
  std::vector<std::string> out;
  tmp_left = false;
  if (!fs::exists(run / "checkpoints")) return out;
  for (const auto& e : fs::directory_iterator(run / "checkpoints")) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0) out.push_back(name);
    if (name.find(".tmp") != std::string::npos) tmp_left = true;
  }
  return out;
}

// Sends `sig` once the run has written `after` steps' metrics; `target` gives the pid to signal.
std::function<void(pid_t)> signal_after(const fs::path& run, int after, int sig, bool& sent,
                                        std::function<pid_t(pid_t)> target) {
  return [=, &sent](pid_t child) {
    if (sent || metrics_lines(run) < after) return;
    const pid_t p = target(child);
    if (p > 0) sent = ::kill(p, sig) == 0;
  };
}

TEST(StopSignal, SigtermStopsAfterTheStepWithACheckpointAndResumeContinues) {
  TempDir tmp("stop_signal");
  const std::string cfg = write_tiny_run(tmp.path(), 100000, 0).string();
  const fs::path run = tmp / "run";
  bool sent = false;
  ProcessResult r = run_moetrain({"train", "-c", cfg, "--set", "train.run_dir=" + run.string()},
                                 {{"OMP_NUM_THREADS", "1"}}, 120, {},
                                 signal_after(run, 3, SIGTERM, sent, [](pid_t p) { return p; }));
  ASSERT_TRUE(sent) << r.output();
  EXPECT_EQ(r.code, 143) << r.output();
  EXPECT_FALSE(r.timed_out) << r.output();
  EXPECT_TRUE(r.output().find("stopped by SIGTERM") != std::string::npos) << r.output();
  const int steps = metrics_lines(run);
  bool tmp_left = true;
  const std::vector<std::string> ck = checkpoints(run, tmp_left);
  EXPECT_FALSE(tmp_left);
  ASSERT_EQ(ck.size(), 1u) << r.output();
  EXPECT_EQ(ck[0], fmt::format("step_{:08d}", steps)) << r.output();

  // The resumed run goes on from that step to a (smaller) end.
  ProcessResult resumed =
      run_moetrain({"train", "-c", cfg, "--resume", "--set", "train.run_dir=" + run.string(),
                    "--set", fmt::format("train.steps={}", steps + 2)},
                   {{"OMP_NUM_THREADS", "1"}}, 120);
  EXPECT_EQ(resumed.code, 0) << resumed.output();
  EXPECT_TRUE(resumed.output().find(fmt::format("at step {}", steps)) != std::string::npos)
      << resumed.output();
  EXPECT_EQ(metrics_lines(run), steps + 2);
}

// A step of many micro-batches does not keep a stop waiting: the stop is checked between them,
// the step is abandoned and the checkpoint is of the last complete step. Without the check this
// step (65,536 micro-batches) runs for minutes and the test times out.
TEST(StopSignal, SigtermInALongStepAbandonsItWithACheckpointOfTheLastCompleteStep) {
  TempDir tmp("stop_signal_accum");
  const std::string cfg = write_tiny_run(tmp.path(), 100000, 0).string();
  const fs::path run = tmp / "run";
  bool sent = false;
  std::optional<std::chrono::steady_clock::time_point> opened;
  ProcessResult r = run_moetrain(
      {"train", "-c", cfg, "--set", "train.run_dir=" + run.string(), "--set",
       "train.grad_accum=65536", "--set", "train.steps=3"},
      {{"OMP_NUM_THREADS", "1"}}, 120, {}, [&](pid_t child) {
        // Once the run opened its metrics, it is in its first step within moments.
        if (sent || !fs::exists(run / "metrics.jsonl")) return;
        if (!opened) opened = std::chrono::steady_clock::now();
        if (std::chrono::steady_clock::now() - *opened > std::chrono::seconds(2))
          sent = ::kill(child, SIGTERM) == 0;
      });
  ASSERT_TRUE(sent) << r.output();
  EXPECT_FALSE(r.timed_out) << r.output();
  EXPECT_EQ(r.code, 143) << r.output();
  EXPECT_NE(r.output().find("stopped by SIGTERM after step 0"), std::string::npos) << r.output();
  EXPECT_NE(r.output().find("(step 1 was abandoned after "), std::string::npos) << r.output();
  EXPECT_EQ(metrics_lines(run), 0);
  bool tmp_left = true;
  const std::vector<std::string> ck = checkpoints(run, tmp_left);
  EXPECT_FALSE(tmp_left);
  ASSERT_EQ(ck.size(), 1u) << r.output();
  EXPECT_EQ(ck[0], "step_00000000");
}

// Under `moetrain launch`, only rank 0 is signalled: both ranks stop after the same step, one
// checkpoint is written, and the supervisor does not restart the job.
TEST(StopSignal, OnlyRankZeroSignalledBothRanksStopAtOneStep) {
  TempDir tmp("stop_signal_mpi");
  const std::string cfg = write_tiny_run(tmp.path(), 100000, 0).string();
  const fs::path run = tmp / "run";
  // Rank 0 holds the run directory's lock and wrote its pid there.
  auto rank0 = [run](pid_t) -> pid_t {
    std::ifstream in(run / ".lock");
    std::string word;
    long pid = 0;
    in >> word >> pid;
    return word == "pid" ? static_cast<pid_t>(pid) : 0;
  };
  bool sent = false;
  ProcessResult r =
      run_moetrain({"launch", "-n", "2", "--max-restarts", "2", "--backoff", "0", "--", "train",
                    "-c", cfg, "--set", "train.run_dir=" + run.string()},
                   mpi_env(), 120, {}, signal_after(run, 3, SIGTERM, sent, rank0));
  ASSERT_TRUE(sent) << r.output();
  EXPECT_EQ(r.code, 143) << r.output();
  EXPECT_EQ(r.count("attempt 2"), 0) << r.output();
  // Each rank says where it stopped; both name the same step.
  std::vector<std::string> stops;
  for (const auto& l : r.lines)
    if (auto at = l.text.find("stopped by SIGTERM after step "); at != std::string::npos)
      stops.push_back(l.text.substr(at, l.text.find(':', at) - at));
  ASSERT_EQ(stops.size(), 2u) << r.output();
  EXPECT_EQ(stops[0], stops[1]) << r.output();
  bool tmp_left = true;
  const std::vector<std::string> ck = checkpoints(run, tmp_left);
  EXPECT_FALSE(tmp_left);
  ASSERT_EQ(ck.size(), 1u) << r.output();
  EXPECT_EQ(ck[0], fmt::format("step_{:08d}", metrics_lines(run))) << r.output();
}

}  // namespace
}  // namespace moetrain::testing
