// Recovery under `moetrain launch` with real faults in real processes (2 ranks under mpirun):
// a rank killed with SIGKILL at a random step, or while a checkpoint is being written, and a
// stalled (SIGSTOPped) rank that the collective watchdog must catch. Each run must complete and
// end with parameters bitwise equal to the uninterrupted run's; the supervisor must leave no
// process behind. The random choices are printed, so that a failure can be replayed.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "ft/ft_support.h"
#include "support/temp_dir.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int kSteps = 12, kCheckpointEvery = 2;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class Recovery : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("recovery");
    config_ = write_tiny_run(dir_->path(), kSteps, kCheckpointEvery).string();
    // A failure here must fail every test: gtest would report a failed suite set-up as skipped
    // tests, which ctest counts as passing.
    ProcessResult r = launch("reference", {}, {"--ep", "2"});
    if (r.code != 0) {
      reference_error_ = fmt::format("the reference run exited {}:\n{}", r.code, r.output());
      return;
    }
    reference_ = load_model(dir_->path() / "reference").params;
  }
  void SetUp() override { ASSERT_TRUE(reference_error_.empty()) << reference_error_; }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }

  // `moetrain launch -n 2` of the tiny run into run directory `run`, with MOETRAIN_FAULT = fault.
  static ProcessResult launch(const std::string& run, const std::string& fault,
                              const std::vector<std::string>& extra,
                              const std::vector<std::string>& launch_args = {"-n", "2"},
                              const std::function<void(const OutputLine&)>& on_line = {}) {
    auto env = mpi_env();
    if (!fault.empty()) env.push_back({"MOETRAIN_FAULT", fault});
    std::vector<std::string> args = {"launch"};
    args.insert(args.end(), launch_args.begin(), launch_args.end());
    for (std::string a : {"--backoff", "0.2", "--mpi-arg=--oversubscribe", "--", "train", "-c"})
      args.push_back(a);
    args.push_back(config_);
    args.push_back("--set");
    args.push_back("train.run_dir=" + (dir_->path() / run).string());
    args.insert(args.end(), extra.begin(), extra.end());
    ProcessResult r = run_moetrain(args, env, 240, on_line);
    EXPECT_FALSE(r.timed_out) << r.output();
    EXPECT_FALSE(r.left_processes) << "processes outlived the supervisor";
    return r;
  }

  static void expect_reference_params(const std::string& run) {
    std::vector<float> params = load_model(dir_->path() / run).params;
    ASSERT_EQ(params.size(), reference_.size());
    EXPECT_EQ(std::memcmp(params.data(), reference_.data(), params.size() * sizeof(float)), 0)
        << run << ": the final parameters differ from the uninterrupted run's";
  }

  static int random_in(int lo, int hi) {
    static std::mt19937 gen(std::random_device{}());
    return std::uniform_int_distribution<int>(lo, hi)(gen);
  }

  static inline TempDir* dir_ = nullptr;
  static inline std::string config_;
  static inline std::vector<float> reference_;
  static inline std::string reference_error_;
};

}  // namespace

TEST_F(Recovery, KillNineAtARandomStepResumesToTheSameParameters) {
  const int step = random_in(1, kSteps - 1), rank = random_in(0, 1);
  const std::string fault = fmt::format("kill:rank={}:step={}", rank, step);
  SCOPED_TRACE("MOETRAIN_FAULT=" + fault);
  ProcessResult r = launch("kill_step", fault, {"--ep", "2"});
  ASSERT_EQ(r.code, 0) << r.output();
  EXPECT_EQ(r.count("moetrain: fault injection: kill"), 1) << r.output();
  EXPECT_TRUE(has(r.output(), "signal 9")) << r.output();
  EXPECT_TRUE(has(r.output(), "succeeded after 2 attempt(s)")) << r.output();
  // The fault fires after step `step`, before its checkpoint: the restart resumes from the one
  // before, so at most one checkpoint interval of work is lost.
  const int last_ckpt = (step - 1) / kCheckpointEvery * kCheckpointEvery;
  if (last_ckpt > 0) {
    EXPECT_TRUE(has(r.output(), fmt::format("at step {}", last_ckpt))) << r.output();
  }
  expect_reference_params("kill_step");
}

TEST_F(Recovery, KillNineWhileACheckpointIsWrittenResumesToTheSameParameters) {
  const int step = kCheckpointEvery * random_in(1, kSteps / kCheckpointEvery - 1);
  const int rank = random_in(0, 1);
  const std::string fault = fmt::format("kill:rank={}:step={}:where=checkpoint_write", rank, step);
  SCOPED_TRACE("MOETRAIN_FAULT=" + fault);
  ProcessResult r = launch("kill_ckpt", fault, {"--ep", "2"});
  ASSERT_EQ(r.code, 0) << r.output();
  EXPECT_EQ(r.count("at checkpoint_write point, step " + std::to_string(step)), 1) << r.output();
  // Rank 0 may or may not have committed the checkpoint it was writing; either way the run
  // resumes from a complete one, the one being written or the one before.
  const bool from_this = has(r.output(), fmt::format("at step {}", step));
  const bool from_before = step == kCheckpointEvery ||
                           has(r.output(), fmt::format("at step {}", step - kCheckpointEvery));
  EXPECT_TRUE(from_this || from_before) << r.output();
  expect_reference_params("kill_ckpt");
}

TEST_F(Recovery, AStoppedRankTripsTheWatchdogAndTheRunCompletes) {
  constexpr double kTimeout = 3;
  const int step = random_in(2, kSteps - 2);
  const std::string fault = fmt::format("stop:rank=1:step={}", step);
  SCOPED_TRACE("MOETRAIN_FAULT=" + fault);
  ProcessResult r =
      launch("stop", fault, {"--ep", "2", "--collective-timeout", "3", "--collective-warn", "1"});
  ASSERT_EQ(r.code, 0) << r.output();
  EXPECT_TRUE(has(r.output(), "collective watchdog")) << r.output();
  EXPECT_TRUE(has(r.output(), "has not completed after")) << r.output();
  EXPECT_TRUE(has(r.output(), "on communicator '")) << r.output();
  EXPECT_TRUE(has(r.output(), "the collective watchdog aborted the job")) << r.output();
  const double stopped = r.time_of("moetrain: fault injection: stop");
  const double failed = r.time_of("attempt 1 failed");
  ASSERT_GE(stopped, 0) << r.output();
  ASSERT_GE(failed, 0) << r.output();
  EXPECT_LE(failed - stopped, kTimeout + 5) << r.output();
  EXPECT_TRUE(has(r.output(), "succeeded after 2 attempt(s)")) << r.output();
  expect_reference_params("stop");
}

TEST_F(Recovery, FewerSlotsAfterAFailureRestartOnFewerProcesses) {
  const fs::path hosts = dir_->path() / "hosts";
  std::ofstream(hosts) << "localhost slots=2\n";
  // The node "loses" a slot when the fault fires; the next attempt re-reads the hostfile.
  auto shrink = [&](const OutputLine& line) {
    if (has(line.text, "moetrain: fault injection")) std::ofstream(hosts) << "localhost slots=1\n";
  };
  ProcessResult r = launch("elastic", "kill:rank=1:step=5", {},
                           {"-n", "2", "--min-procs", "1", "--hostfile", hosts.string()}, shrink);
  ASSERT_EQ(r.code, 0) << r.output();
  EXPECT_TRUE(has(r.output(), "attempt 1: 2 process(es)")) << r.output();
  EXPECT_TRUE(has(r.output(), "attempt 2: 1 process(es)")) << r.output();
  EXPECT_TRUE(has(r.output(), "reached step 12")) << r.output();
  // The resumed run on one process takes two micro-batches per step: the global batch is kept.
  EXPECT_TRUE(has(r.output(), "train.grad_accum = 2 instead of 1")) << r.output();
}
