// The scheduler killed with no standby, real processes: the servers elect the first live one of
// the succession order (ps/election.h), which runs the scheduler in its own process; the job ends
// with bitwise the parameters of the undisturbed sync run, and the election with its cause is in
// metrics/scheduler.jsonl. The standby's takeover is in server_fault_slow_test.cpp.
#include <gtest/gtest.h>

#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "io/metrics.h"
#include "ps/job_events.h"
#include "ps/process.h"        // tests/ps/process.h
#include "ps/sync_reference.h"  // tests/ps/sync_reference.h

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

class PsElection : public SyncReference {};

// The scheduler killed with no standby: the servers elect the first live one in the succession
// order (server 0), which runs the scheduler in its own process; the nodes register there as
// they would with a standby, the run ends, and the final parameters are bitwise the undisturbed
// run's. The election and its cause are the elected scheduler's first events.
TEST_F(PsElection, ServerElectedWhenTheSchedulerDiesWithoutAStandby) {
  // Both workers at --slowdown 30 keep the run long enough for the takeover to land inside it.
  Cluster c(tmp_->path(), "elect", 2, kSteps, 2, {"--servers", "2"}, "1", 30.0);
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 20; }, 60)) << c.logs();
  Process* lead = c.find("server", 0);
  ASSERT_NE(lead, nullptr) << c.logs();
  const double killed_at = ps::unix_seconds();
  c.scheduler->kill(SIGKILL);
  ASSERT_LT(applied_steps(c.run), kSteps) << "the job ended before the kill";
  ASSERT_TRUE(wait_until(
      [&] { return lead->output().find("server 0 (elected) takes over") != std::string::npos; },
      30))
      << c.logs();
  EXPECT_LT(applied_steps(c.run), kSteps) << "the takeover came after the last clock";
  EXPECT_EQ(lead->wait(150), 0) << c.logs();
  for (auto& s : c.servers) EXPECT_EQ(s->wait(30), 0) << c.logs();
  for (auto& w : c.workers) EXPECT_EQ(w->wait(30), 0) << c.logs();
  EXPECT_EQ(applied_steps(c.run), kSteps) << "every clock applied exactly once";
  expect_reference_params(c.run);

  // metrics/scheduler.jsonl: the dead scheduler's events, then the elected one's.
  std::vector<nlohmann::json> events =
      read_metrics_file(c.run / "metrics" / "scheduler.jsonl");
  std::vector<std::string> names;
  for (const auto& e : events) names.push_back(e.value("event", ""));
  const auto at = [&](const std::string& name) {
    return std::find(names.begin(), names.end(), name) - names.begin();
  };
  const auto elected = at("scheduler_elected"), takeover = at("scheduler_takeover"),
             complete = at("job_complete");
  ASSERT_LT(elected, static_cast<std::ptrdiff_t>(events.size())) << nlohmann::json(names).dump();
  ASSERT_LT(takeover, static_cast<std::ptrdiff_t>(events.size())) << nlohmann::json(names).dump();
  EXPECT_LT(at("job_start"), elected);
  EXPECT_LT(elected, takeover);
  EXPECT_LT(takeover, complete);
  EXPECT_EQ(complete + 1, static_cast<std::ptrdiff_t>(events.size()));
  const nlohmann::json& e = events[static_cast<std::size_t>(elected)];
  EXPECT_EQ(e.value("server", int64_t{-1}), 0) << e.dump();
  EXPECT_TRUE(e.value("primary", false)) << e.dump();
  EXPECT_EQ(e.at("passed_over").size(), 0u) << e.dump();
  EXPECT_EQ(e.value("dead_scheduler", ""), c.endpoint) << e.dump();
  EXPECT_NE(e["cause"].get<std::string>().find("first live server"), std::string::npos)
      << e.dump();
  EXPECT_EQ(events[static_cast<std::size_t>(takeover)].value("by", ""), "elected server");
  // The takeover time: from the kill to the elected scheduler's takeover event, and to the first
  // clock applied after the kill (training goes on while the nodes are without a scheduler).
  // The longest wait between two clocks after the kill, against the median step, shows whether
  // the workers paused while they moved.
  double first_clock = -1, longest = 0, prev = -1;
  std::vector<double> steps;
  for (const auto& m : read_metrics(c.run)) {
    if (!m.contains("loss")) continue;
    const double t = m["time"].get<double>();
    if (prev >= 0) steps.push_back(t - prev);
    if (prev >= 0 && t > killed_at) longest = std::max(longest, t - prev);
    if (first_clock < 0 && t > killed_at) first_clock = t;
    prev = t;
  }
  std::sort(steps.begin(), steps.end());
  const double took = events[static_cast<std::size_t>(takeover)]["time"].get<double>() - killed_at;
  std::printf(
      "kill to takeover: %.3f s; kill to the first clock after it: %.3f s; longest gap between "
      "clocks after the kill: %.3f s (median %.3f s)\n",
      took, first_clock - killed_at, longest, steps.empty() ? 0.0 : steps[steps.size() / 2]);
  EXPECT_GT(took, 0);
  EXPECT_GT(first_clock, killed_at);
}

// The scheduler and server 0's primary killed together (--server-replicas 2): the nodes pass over
// the dead primary after twice the heartbeat timeout and elect the next server of the order,
// server 0's backup, whose takeover promotes it; the job ends bitwise as the undisturbed run.
TEST_F(PsElection, ElectionPassesOverADeadPrimaryAndItsBackupTakesOver) {
  Cluster c(tmp_->path(), "elect_backup", 2, kSteps, 4, {"--servers", "2", "--server-replicas", "2"},
            "1", 10.0);
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 20; }, 60)) << c.logs();
  Process* primary = c.find("server", 0, true);
  Process* backup = c.find("server", 0, false);
  ASSERT_NE(primary, nullptr) << c.logs();
  ASSERT_NE(backup, nullptr) << c.logs();
  const double killed_at = ps::unix_seconds();
  c.scheduler->kill(SIGKILL);
  primary->kill(SIGKILL);
  ASSERT_LT(applied_steps(c.run), kSteps) << "the job ended before the kill";
  ASSERT_TRUE(wait_until(
      [&] { return backup->output().find("server 0 (elected) takes over") != std::string::npos; },
      30))
      << c.logs();
  EXPECT_EQ(backup->wait(150), 0) << c.logs();
  for (auto& s : c.servers) {
    if (s.get() == primary) continue;
    EXPECT_EQ(s->wait(30), 0) << c.logs();
  }
  for (auto& w : c.workers) EXPECT_EQ(w->wait(30), 0) << c.logs();
  EXPECT_EQ(applied_steps(c.run), kSteps) << "every clock applied exactly once";
  expect_reference_params(c.run);

  nlohmann::json elected, failover, takeover;
  for (const auto& e : read_metrics_file(c.run / "metrics" / "scheduler.jsonl")) {
    if (e.value("event", "") == "scheduler_elected") elected = e;
    if (e.value("event", "") == "failover" && !elected.is_null()) failover = e;
    if (e.value("event", "") == "scheduler_takeover") takeover = e;
  }
  if (takeover.is_object())
    std::printf("kill to takeover (one server passed over): %.3f s\n",
                takeover["time"].get<double>() - killed_at);
  ASSERT_TRUE(elected.is_object()) << "no scheduler_elected event";
  EXPECT_EQ(elected.value("server", int64_t{-1}), 0) << elected.dump();
  EXPECT_FALSE(elected.value("primary", true)) << elected.dump();
  ASSERT_EQ(elected.at("passed_over").size(), 1u) << elected.dump();
  EXPECT_EQ(elected["passed_over"][0].value("server", int64_t{-1}), 0) << elected.dump();
  EXPECT_NE(elected.value("cause", "").find("1 server(s) before it did not answer"),
            std::string::npos)
      << elected.dump();
  ASSERT_TRUE(failover.is_object()) << "the backup was not promoted in the takeover";
  EXPECT_EQ(failover.value("index", int64_t{-1}), 0) << failover.dump();
}

// The same through `ps launch` without --standby-scheduler: launch waits for the nodes, the
// elected server ends the job, launch exits 0 and the final parameters are the undisturbed run's.
TEST_F(PsElection, LaunchedJobElectsAServerWhenTheSchedulerDies) {
  const fs::path run = tmp_->path() / "launch_elect";
  std::vector<std::string> args = {"ps", "launch", "--timeout", "150", "--servers", "2",
                                   "--workers", "2", "--heartbeat-interval", "0.1",
                                   "--heartbeat-timeout", "1", "--slowdown", "1=30", "--",
                                   "train"};
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp_->path() / "data", run, kSteps, 2)))
    args.push_back(s);
  Process job(args, tmp_->path() / "launch_elect.log");
  ASSERT_TRUE(wait_until([&] { return applied_steps(run) >= 20; }, 60)) << job.output();
  pid_t scheduler = -1;
  const auto pids = read_json(run / "ps" / "launch.json");
  for (const auto& p : pids["processes"])
    if (p["name"] == "scheduler") scheduler = p["pid"].get<pid_t>();
  ASSERT_GT(scheduler, 0) << pids.dump();
  ASSERT_EQ(::kill(scheduler, SIGKILL), 0);
  ASSERT_LT(applied_steps(run), kSteps) << "the job ended before the kill";
  ASSERT_TRUE(wait_until(
      [&] { return job.output().find("server 0 (elected) takes over") != std::string::npos; },
      30))
      << job.output();
  EXPECT_LT(applied_steps(run), kSteps) << "the takeover came after the last clock";
  ASSERT_EQ(job.wait(150), 0) << job.output();
  EXPECT_NE(job.output().find("the servers elect one of themselves"), std::string::npos)
      << job.output();
  EXPECT_EQ(applied_steps(run), kSteps) << "every clock applied exactly once";
  expect_reference_params(run);
}

}  // namespace
