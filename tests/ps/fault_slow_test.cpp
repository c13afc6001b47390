// Failures of real processes: a worker killed with SIGKILL mid-run is detected by its missing
// heartbeats and the sync job goes on with the others (its rows handed over); a restarted worker
// rejoins at the current clock; a killed scheduler with no server left to take its role ends
// every worker with a clear message.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "ps/process.h"  // tests/ps/process.h
#include "support/temp_dir.h"

using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

TEST(PsFault, KilledWorkerIsReplacedAndTheRunCompletes) {
  TempDir tmp("ps_fault");
  const int steps = 300;
  // The undisturbed run.
  {
    Cluster ref(tmp.path(), "ref", 3, steps);
    ASSERT_EQ(ref.scheduler->wait(150), 0) << ref.logs();
  }
  Cluster c(tmp.path(), "run", 3, steps);
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 20; }, 60)) << c.logs();
  c.workers[1]->kill(SIGKILL);
  const int64_t at_kill = applied_steps(c.run);
  // Detected within the heartbeat timeout (1 s), then sync goes on with two workers.
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= at_kill + 10; }, 30)) << c.logs();
  // A restarted worker takes index 1 again and joins at the current clock.
  c.add_worker(1, 1.0);
  ASSERT_EQ(c.scheduler->wait(150), 0) << c.logs();
  for (auto& w : {0, 2, 3}) EXPECT_EQ(c.workers[w]->wait(30), 0) << c.logs();
  EXPECT_EQ(c.servers[0]->wait(30), 0) << c.logs();

  auto sched = read_json(c.run / "ps" / "scheduler.json");
  EXPECT_EQ(sched["workers_lost"].get<int64_t>(), 1);
  EXPECT_EQ(sched["workers_joined"].get<int64_t>(), 1);
  bool rejoined = false;
  for (const auto& e : fs::directory_iterator(c.run / "ps")) {
    if (!e.path().filename().string().starts_with("worker_node")) continue;
    auto j = read_json(e.path());
    if (j["index"] == 1 && j["first_clock"].get<int64_t>() > 20) rejoined = true;
  }
  EXPECT_TRUE(rejoined) << "no worker 1 started past clock 20";
  EXPECT_EQ(applied_steps(c.run), steps);  // no clock lost or repeated
  const double a = val_loss(c.run), b = val_loss(c.run.parent_path() / "ref");
  EXPECT_GT(a, 0);
  EXPECT_NEAR(a, b, 0.1) << "disturbed " << a << " vs undisturbed " << b;
}

// Without a standby the servers elect a new scheduler (server_fault_slow_test.cpp); with the
// scheduler and every server gone there is none to elect, and the workers end.
TEST(PsFault, SchedulerDeathWithNoServerLeftEndsTheJobWithAClearMessage) {
  TempDir tmp("ps_sched");
  Cluster c(tmp.path(), "run", 2, 100000);
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 5; }, 60)) << c.logs();
  // Every worker has had the succession order with a heartbeat acknowledgement (every 0.1 s)
  // since the server registered: five steps may take less than one heartbeat interval.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  c.scheduler->kill(SIGKILL);
  c.servers[0]->kill(SIGKILL);
  for (auto& w : c.workers) EXPECT_EQ(w->wait(20), 1) << c.logs();
  for (auto& w : c.workers) {
    EXPECT_NE(w->output().find("registering with server 0 (node"), std::string::npos) << c.logs();
    EXPECT_NE(w->output().find("none of the 1 server(s) of the succession order answered"),
              std::string::npos)
        << c.logs();
  }
}

}  // namespace
