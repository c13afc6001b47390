// `moetrain launch` as a user meets it (real processes of the built binary, real mpirun), and
// the pieces behind it: fault specs, hostfile slots, job status, fingerprints, config keys.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include <string>
#include <vector>

#include "core/fault.h"
#include "ft/ft_support.h"
#include "io/metrics.h"
#include "parallel/supervisor.h"
#include "parallel/watchdog.h"
#include "support/expect_error.h"
#include "support/temp_dir.h"
#include "train/run_config.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST(FaultSpec, ParsesEveryFieldAndNamesBadOnes) {
  FaultSpec s = parse_fault_spec("kill:rank=1:step=7:where=checkpoint_write");
  EXPECT_EQ(s.action, FaultAction::Kill);
  EXPECT_EQ(s.rank, 1);
  EXPECT_EQ(s.step, 7);
  EXPECT_EQ(s.where, "checkpoint_write");
  EXPECT_EQ(s.attempt, 1);
  s = parse_fault_spec("exit:step=2:attempt=0:code=9");
  EXPECT_EQ(s.action, FaultAction::Exit);
  EXPECT_EQ(s.rank, 0);
  EXPECT_EQ(s.attempt, 0);
  EXPECT_EQ(s.exit_code, 9);
  EXPECT_EQ(parse_fault_spec("stop:step=3").action, FaultAction::Stop);
  expect_error([] { parse_fault_spec("explode:step=1"); }, {"explode", "kill, stop, exit"});
  expect_error([] { parse_fault_spec("kill:rank=1"); }, "step=S is required");
  expect_error([] { parse_fault_spec("kill:step=x"); }, {"step = 'x'", "integer"});
  expect_error([] { parse_fault_spec("kill:step=1:where=forward"); }, {"forward", "checkpoint"});
  expect_error([] { parse_fault_spec("kill:step=1:colour=red"); }, "key 'colour' unknown");
  expect_error([] { parse_fault_spec("kill:step"); }, "not key=value");
  expect_error([] { parse_fault_spec("exit:step=1:code=0"); }, "code = 0");
  s = parse_fault_spec("slow:rank=1:step=2:ms=40");
  EXPECT_EQ(s.action, FaultAction::Slow);
  EXPECT_EQ(s.slow_ms, 40);
  // A slow link from the start: no step needed.
  s = parse_fault_spec("comm_delay:rank=1:ms=25");
  EXPECT_EQ(s.action, FaultAction::CommDelay);
  EXPECT_EQ(s.rank, 1);
  EXPECT_EQ(s.slow_ms, 25);
  expect_error([] { parse_fault_spec("explode:step=1"); }, "comm_delay");
  EXPECT_EQ(parse_fault_spec("slow:step=0").slow_ms, 100);
  expect_error([] { parse_fault_spec("slow:step=1:ms=-5"); }, {"ms = '-5'", "integer"});
  // A link change for the adaptive route: path slow from the step on (direct by default).
  s = parse_fault_spec("route_delay:step=4:ms=30:path=relay");
  EXPECT_EQ(s.action, FaultAction::RouteDelay);
  EXPECT_EQ(s.step, 4);
  EXPECT_TRUE(s.slow_relay);
  EXPECT_FALSE(parse_fault_spec("route_delay:step=4").slow_relay);
  expect_error([] { parse_fault_spec("route_delay:step=4:path=ring"); },
               {"path = 'ring'", "direct, relay"});
  expect_error([] { parse_fault_spec("route_delay:ms=3"); }, "step=S is required");
}

TEST(Hostfile, CountsSlotsAndNamesBadLines) {
  TempDir tmp("hostfile");
  auto good = tmp.write("hosts", "# cluster\nnode1 slots=4\nnode2 slots=2 max_slots=8\nnode3\n\n");
  EXPECT_EQ(hostfile_slots(good.string()), 7);
  auto bad = tmp.write("bad", "node1 slots=4\nnode2 cores=2\n");
  expect_error([&] { hostfile_slots(bad.string()); }, {"line 2", "cores=2"});
  auto neg = tmp.write("neg", "node1 slots=-1\n");
  expect_error([&] { hostfile_slots(neg.string()); }, {"line 1", "slots"});
  expect_error([&] { hostfile_slots((tmp / "missing").string()); }, "cannot be read");
  EXPECT_GE(machine_slots(), 1);
}

TEST(JobStatus, NamesHowTheJobEnded) {
  EXPECT_EQ(describe_job_status(0), "completed");
  EXPECT_TRUE(has(describe_job_status(3 << 8), "exit code 3"));
  EXPECT_TRUE(has(describe_job_status(kCollectiveTimeoutExit << 8), "collective watchdog"));
  EXPECT_TRUE(has(describe_job_status(137 << 8), "signal 9"));
  EXPECT_TRUE(has(describe_job_status(SIGKILL), "mpirun died of signal 9"));
}

TEST(JobStatus, TheJobsFirstErrorIsItsMessage) {
  EXPECT_EQ(job_error("[vm:1] banner\nmoetrain: error: data.dir = 'x' has no train.bin\n"
                      "moetrain: error: the other rank's\n"),
            "data.dir = 'x' has no train.bin");
  EXPECT_EQ(job_error("moetrain: fault injection: exit rank 1 at step 1\n"), "");
}

TEST(Fingerprint, MismatchNamesBothRanksAndCalls) {
  CollectiveFingerprint a{5, static_cast<int32_t>(CollectiveKind::Alltoallv),
                          static_cast<int32_t>(CollectiveOp::Allreduce), 4, 0};
  CollectiveFingerprint b = a;
  std::vector<CollectiveFingerprint> same = {a, a, a};
  EXPECT_EQ(fingerprint_mismatch(same, 1, "grads"), "");
  b.kind = static_cast<int32_t>(CollectiveKind::Barrier);
  b.op = 0;
  std::vector<CollectiveFingerprint> skip = {a, a, b};
  const std::string m = fingerprint_mismatch(skip, 0, "grads");
  EXPECT_TRUE(has(m, "'grads'")) << m;
  EXPECT_TRUE(has(m, "rank 0 calls alltoallv #5 (in allreduce of 4-byte elements)")) << m;
  EXPECT_TRUE(has(m, "rank 2 calls barrier #5")) << m;
  std::vector<CollectiveFingerprint> sizes = {a, a};
  sizes[1].agree = 7;
  EXPECT_TRUE(has(fingerprint_mismatch(sizes, 1, "c"), "different sizes"));
}

TEST(RunConfigKeys, WatchdogKeysAreValidated) {
  RunConfig c = load_run_config(
      "", {"dist.collective_warn=5", "dist.collective_timeout=20", "dist.debug_collectives=true"});
  EXPECT_EQ(c.dist.collective_warn, 5);
  EXPECT_EQ(c.dist.collective_timeout, 20);
  EXPECT_TRUE(c.dist.debug_collectives);
  expect_error([] { load_run_config("", {"dist.collective_timeout=-1"}); },
               "dist.collective_timeout = -1");
  expect_error([] { load_run_config("", {"dist.collective_warn=-2"}); }, "dist.collective_warn");
  // Not part of the config hash: a run may resume with another timeout.
  EXPECT_EQ(load_run_config("", {"dist.collective_timeout=3"}).config_hash(),
            RunConfig().config_hash());
}

TEST(Launch, BadFlagsAreClearErrorsWithExitTwo) {
  TempDir tmp("launch_flags");
  const std::string cfg = write_tiny_run(tmp.path(), 4, 2).string();
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{"launch", "-n", "0", "--", "train", "-c", cfg}, "-n 0: must be ≥ 1"},
      {{"launch", "-n", "2", "train", "-c", cfg}, "missing `--`"},
      {{"launch", "-n", "2", "--", "trian", "-c", cfg}, "'trian' after `--`"},
      {{"launch", "-n", "2", "--"}, "nothing after `--`"},
      {{"launch", "-n", "2", "--", "train", "-c", cfg, "--bogus"}, "--bogus"},
      {{"launch", "-n", "2", "--min-procs", "3", "--", "train", "-c", cfg}, "--min-procs 3"},
      {{"launch", "-n", "2", "--fast", "--", "train", "-c", cfg}, "'--fast' before `--`"},
      {{"launch", "-n", "2", "train", "--", "train", "-c", cfg}, "not expected"},
      {{"launch", "--", "train", "-c", cfg}, "-n"},
  };
  for (const Case& c : cases) {
    ProcessResult r = run_moetrain(c.args, mpi_env(), 30);
    EXPECT_EQ(r.code, 2) << r.output();
    EXPECT_TRUE(has(r.output(), c.expect)) << "expected '" << c.expect << "' in:\n" << r.output();
    EXPECT_EQ(r.count("attempt 1"), 0) << r.output();  // nothing was launched
  }
}

TEST(Launch, ABadConfigOrLauncherStopsWithoutRetrying) {
  TempDir tmp("launch_bad");
  ProcessResult cfg = run_moetrain(
      {"launch", "-n", "2", "--", "train", "-c", (tmp / "absent.toml").string()}, mpi_env(), 30);
  EXPECT_EQ(cfg.code, 1) << cfg.output();
  EXPECT_TRUE(has(cfg.output(), "absent.toml")) << cfg.output();
  EXPECT_EQ(cfg.count("attempt 1"), 0) << cfg.output();
  const std::string config = write_tiny_run(tmp.path(), 4, 2).string();
  ProcessResult mpirun = run_moetrain(
      {"launch", "-n", "2", "--mpirun", (tmp / "no-mpirun").string(), "--", "train", "-c", config},
      mpi_env(), 30);
  EXPECT_EQ(mpirun.code, 1) << mpirun.output();
  EXPECT_TRUE(has(mpirun.output(), "cannot run")) << mpirun.output();
  EXPECT_EQ(mpirun.count("attempt 2"), 0) << mpirun.output();
}

// A refusal of mpirun's that a retry would meet again (here: running as root) stops launch at
// once with mpirun's reason, without the back-off and restarts; --mpi-arg passes the flag that
// lifts it.
TEST(Launch, AnMpirunRefusalStopsAtOnceWithItsReason) {
  TempDir tmp("launch_refusal");
  const std::string config = write_tiny_run(tmp.path(), 4, 2).string();
  const auto fake = tmp.write("fake-mpirun",
                              "#!/bin/sh\necho '---'>&2\n"
                              "echo 'mpirun has detected an attempt to run as root.' >&2\n"
                              "exit 1\n");
  std::filesystem::permissions(fake, std::filesystem::perms::owner_all);
  ProcessResult r = run_moetrain({"launch", "-n", "2", "--backoff", "30", "--mpirun", fake.string(),
                                  "--", "train", "-c", config},
                                 mpi_env(), 25);
  EXPECT_EQ(r.code, 1) << r.output();
  EXPECT_TRUE(has(r.output(), "mpirun refuses to run as root: pass --mpi-arg=--allow-run-as-root"))
      << r.output();
  EXPECT_TRUE(has(r.output(), "would not on a retry")) << r.output();
  EXPECT_EQ(r.count("attempt 2"), 0) << r.output();
  EXPECT_EQ(r.count("restart 1"), 0) << r.output();
  if (::geteuid() != 0) GTEST_SKIP() << "the real mpirun refuses root only; not root here";
  // The real mpirun, without the variables that let it run as root.
  const auto strict = tmp.write(
      "strict-mpirun",
      "#!/bin/sh\nexec env -u OMPI_ALLOW_RUN_AS_ROOT -u OMPI_ALLOW_RUN_AS_ROOT_CONFIRM mpirun "
      "\"$@\"\n");
  std::filesystem::permissions(strict, std::filesystem::perms::owner_all);
  ProcessResult root = run_moetrain({"launch", "-n", "2", "--backoff", "30", "--mpirun",
                                     strict.string(), "--", "train", "-c", config},
                                    mpi_env(), 25);
  EXPECT_EQ(root.code, 1) << root.output();
  EXPECT_TRUE(has(root.output(), "mpirun refuses to run as root")) << root.output();
  EXPECT_EQ(root.count("attempt 2"), 0) << root.output();
  ProcessResult allowed = run_moetrain(
      {"launch", "-n", "2", "--mpirun", strict.string(), "--mpi-arg=--allow-run-as-root",
       "--mpi-arg=--oversubscribe", "--", "train", "-c", config},
      mpi_env(), 120);
  EXPECT_EQ(allowed.code, 0) << allowed.output();
}

// train's flags that set keys count for launch too: --run-dir moves where it keeps its record.
TEST(Launch, TrainFlagsThatSetKeysAreHonoured) {
  TempDir tmp("launch_flags_keys");
  const std::string config = write_tiny_run(tmp.path(), 4, 2).string();
  const auto fake = tmp.write("fake-mpirun", "#!/bin/sh\nexit 3\n");
  std::filesystem::permissions(fake, std::filesystem::perms::owner_all);
  const std::string moved = (tmp / "moved").string();
  ProcessResult r = run_moetrain({"launch", "-n", "2", "--max-restarts", "0", "--mpirun",
                                  fake.string(), "--", "train", "-c", config, "--run-dir", moved},
                                 mpi_env(), 25);
  EXPECT_EQ(r.code, 1) << r.output();
  EXPECT_TRUE(
      std::filesystem::exists(std::filesystem::path(moved) / kRoleMetricsDir / "launcher.jsonl"))
      << r.output();
}

TEST(Launch, MpirunRefusalsAreTold) {
  EXPECT_EQ(mpirun_refusal("rank 1 died\n"), "");
  EXPECT_TRUE(has(mpirun_refusal("mpirun: Error: unknown option \"--bogus\"\nType 'mpirun --help'"),
                  "unknown option \"--bogus\""));
  EXPECT_EQ(mpirun_refusal("mpirun: Error: unknown option \"--bogus\"\nType"),
            "mpirun: Error: unknown option \"--bogus\"");
  EXPECT_TRUE(has(mpirun_refusal("mpirun was unable to launch the specified application as it "
                                 "could not access\nor execute an executable:\n\nExecutable: "
                                 "/x/y\nNode: vm\n"),
                  "(Executable: /x/y)"));
}

// Data that every attempt would refuse is named before the first one: the ranks run on this
// machine (no --hostfile), whose data.dir the launcher reads.
TEST(Launch, MissingDataIsNamedBeforeAnyAttempt) {
  TempDir tmp("launch_nodata");
  const std::string cfg = write_tiny_run(tmp.path(), 4, 2).string();
  ProcessResult r = run_moetrain({"launch", "-n", "2", "--", "train", "-c", cfg, "--set",
                                  "data.dir=" + (tmp / "nodata").string()},
                                 mpi_env(), 30);
  EXPECT_EQ(r.code, 1) << r.output();
  EXPECT_TRUE(has(r.output(), "nodata' has no train.bin: prepare it first")) << r.output();
  EXPECT_EQ(r.count("attempt 1"), 0) << r.output();
}

// An error the job meets where it starts, which the launcher cannot see for itself (here expert
// parallelism that does not divide the processes): the second attempt meets it again without
// progress, and launch stops there with the error instead of spending its restarts.
TEST(Launch, TheSameErrorTwiceWithoutProgressEndsTheRestarts) {
  TempDir tmp("launch_same");
  const std::string cfg = write_tiny_run(tmp.path(), 4, 2).string();
  ProcessResult r = run_moetrain(
      {"launch", "-n", "2", "--max-restarts", "3", "--backoff", "0", "--mpi-arg=--oversubscribe",
       "--", "train", "-c", cfg, "--set", "dist.ep=3", "--set", "model.n_experts=6", "--set",
       "train.run_dir=" + (tmp / "run").string()},
      mpi_env(), 60);
  ASSERT_FALSE(r.timed_out) << r.output();
  EXPECT_EQ(r.code, 1) << r.output();
  EXPECT_FALSE(r.left_processes);
  EXPECT_TRUE(has(r.output(), "failed after 2 attempt(s)")) << r.output();
  EXPECT_TRUE(has(r.output(), "attempts 1 and 2 failed with the same error without progress"))
      << r.output();
  EXPECT_TRUE(has(r.output(), "ep 3")) << r.output();
  EXPECT_EQ(r.count("attempt 3"), 0) << r.output();
}

TEST(Launch, TooFewSlotsForMinProcsIsNeverLaunched) {
  TempDir tmp("launch_slots");
  const std::string cfg = write_tiny_run(tmp.path(), 4, 2).string();
  const auto hosts = tmp.write("hosts", "localhost slots=1\n");
  ProcessResult r =
      run_moetrain({"launch", "-n", "2", "--min-procs", "2", "--hostfile", hosts.string(),
                    "--max-restarts", "1", "--backoff", "0", "--", "train", "-c", cfg},
                   mpi_env(), 30);
  EXPECT_EQ(r.code, 1) << r.output();
  EXPECT_EQ(r.count("not launched, only 1 slot(s) available"), 2) << r.output();
  EXPECT_TRUE(has(r.output(), "restart budget spent (--max-restarts 1)")) << r.output();
  EXPECT_EQ(r.count("mpirun --hostfile"), 0) << r.output();
}

TEST(Launch, RestartBudgetSpentByAFailureOnEveryAttempt) {
  TempDir tmp("launch_budget");
  const std::string cfg = write_tiny_run(tmp.path(), 6, 2).string();
  auto env = mpi_env();
  env.push_back({"MOETRAIN_FAULT", "exit:rank=1:step=1:attempt=0:code=3"});
  ProcessResult r = run_moetrain(
      {"launch", "-n", "2", "--max-restarts", "2", "--backoff", "0.1", "--mpi-arg=--oversubscribe",
       "--", "train", "-c", cfg, "--set", "train.run_dir=" + (tmp / "run").string()},
      env, 120);
  ASSERT_FALSE(r.timed_out) << r.output();
  EXPECT_EQ(r.code, 1) << r.output();
  EXPECT_FALSE(r.left_processes);
  EXPECT_EQ(r.count("moetrain: fault injection: exit rank 1"), 3) << r.output();
  EXPECT_TRUE(has(r.output(), "failed after 3 attempt(s)")) << r.output();
  EXPECT_TRUE(has(r.output(), "restart budget spent (--max-restarts 2); last failure: exit code 3"))
      << r.output();
  // Later attempts resume; the summary lists each attempt with its reason.
  EXPECT_EQ(r.count("--resume"), 2) << r.output();
  EXPECT_EQ(r.count("  attempt "), 3) << r.output();
  // One launcher.jsonl line per attempt, with its cause.
  const auto roles = read_role_metrics(tmp / "run");
  ASSERT_TRUE(roles.contains("launcher")) << "no RUN_DIR/metrics/launcher.jsonl";
  const auto& lines = roles.at("launcher");
  ASSERT_EQ(lines.size(), 3u);
  for (std::size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(lines[i].at("attempt").get<int>(), static_cast<int>(i) + 1);
    EXPECT_EQ(lines[i].at("event").get<std::string>(), "attempt_failed");
    EXPECT_EQ(lines[i].at("cause").get<std::string>(), "exit code 3");
  }
}
