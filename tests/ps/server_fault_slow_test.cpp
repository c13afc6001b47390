// Server failures of real processes. A primary killed with SIGKILL while its backup streams
// every applied update: the backup is promoted, workers re-route, and the final parameters are
// bitwise those of the undisturbed sync run (the backup applies the primary's exact optimizer
// input with the same code, and a pull is answered only with updates the backup confirmed).
// A promoted primary gets a new backup (the restarted server), which streams from it, so a second
// failure of the same shard is survived the same way.
// A server without a replica killed and started again by hand: every server rolls back to the
// newest checkpoint they all hold, workers go back to its clock and re-pull, and the final
// parameters are again bitwise those of the undisturbed run (sync replays the same clocks on the
// same rows from the same state).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "io/metrics.h"
#include "ps/process.h"         // tests/ps/process.h
#include "ps/sync_reference.h"  // tests/ps/sync_reference.h
#include "support/corpus.h"
#include "support/temp_dir.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

class PsServerFault : public SyncReference {};

TEST_F(PsServerFault, KilledPrimaryIsReplacedByItsBackupWithNoUpdateLost) {
  Cluster c(tmp_->path(), "replica", 2, kSteps, 4, {"--servers", "2", "--server-replicas", "2"},
            "2");
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 30; }, 60)) << c.logs();
  // Server 0's primary also writes the metrics: its backup must take that over too.
  Process* primary = c.find("server", 0, true);
  ASSERT_NE(primary, nullptr) << c.logs();
  primary->kill(SIGKILL);
  const int64_t at_kill = applied_steps(c.run);
  ASSERT_LT(at_kill, kSteps) << "the job ended before the kill";
  ASSERT_EQ(c.scheduler->wait(150), 0) << c.logs();
  for (auto& w : c.workers) EXPECT_EQ(w->wait(30), 0) << c.logs();

  auto sched = read_json(c.run / "ps" / "scheduler.json");
  EXPECT_EQ(sched["failovers"].get<int64_t>(), 1);
  EXPECT_EQ(sched["rollbacks"].get<int64_t>(), 0);
  // The primary streams an update to its backup before it appends the update's line, and answers
  // a pull only once the backup confirmed: the backup holds every update the primary wrote a line
  // for but the last, which may have died in the primary's send queue (its workers push it again).
  auto s0 = read_json(c.run / "ps" / "server_0.json");
  EXPECT_GE(s0["updates_replicated_in"].get<int64_t>(), at_kill - 1) << s0.dump();
  EXPECT_EQ(s0["updates"].get<int64_t>(), kSteps);
  // Every clock is applied exactly once (the server's count above, and the parameters below).
  // The metrics file says the same but for one line: the primary may die between streaming an
  // update to its backup and appending that update's line; a line of an update that died with
  // it is dropped by the promoted backup, which applies and writes it again.
  EXPECT_GE(applied_steps(c.run), kSteps - 1);
  EXPECT_LE(applied_steps(c.run), kSteps);
  expect_reference_params(c.run);
}

// After the promotion the restarted server becomes the promoted primary's new backup: it takes the
// primary's whole state (values, optimizer state, clock), then its replicated updates, so when the
// promoted one is killed too, it is promoted in turn and still no update is lost.
// The workers are paced (slowdown 10): starting the new backup process and sending it the state
// takes a wall-clock time that does not shrink with the step time, and on a loaded machine an
// unpaced job once ran from clock 20 to 107 before the new backup held the state, leaving too few
// steps for the second failure.
TEST_F(PsServerFault, PromotedPrimaryGetsANewBackupAndSurvivesASecondFailure) {
  Cluster c(tmp_->path(), "second", 2, kSteps, 4, {"--servers", "2", "--server-replicas", "2"},
            "2", 10.0);
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 20; }, 60)) << c.logs();
  Process* first = c.find("server", 0, true);
  ASSERT_NE(first, nullptr) << c.logs();
  first->kill(SIGKILL);
  ASSERT_TRUE(wait_until(
      [&] { return c.scheduler->output().find("is promoted") != std::string::npos; }, 30))
      << c.logs();
  const int64_t at_first = applied_steps(c.run);
  ASSERT_LT(at_first, kSteps) << "the job ended before the first kill";
  c.add_server();  // the restarted old primary
  ASSERT_TRUE(wait_until(
      [&] {
        return c.servers.back()->output().find("took its primary's state") != std::string::npos;
      },
      30))
      << c.logs();
  // Updates now stream to the new backup; then the promoted primary dies as well.
  const int64_t at_snapshot = applied_steps(c.run);
  ASSERT_LT(at_snapshot + 10, kSteps - 2)
      << "the new backup took the state too late to stream 10 updates before the job ends\n"
      << c.logs();
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= at_snapshot + 10; }, 60)) << c.logs();
  Process* second = c.find("server", 0, true);
  ASSERT_NE(second, nullptr) << c.logs();
  ASSERT_NE(second, first);
  second->kill(SIGKILL);
  ASSERT_LT(applied_steps(c.run), kSteps) << "the job ended before the second kill";
  ASSERT_EQ(c.scheduler->wait(150), 0) << c.logs();
  for (auto& w : c.workers) EXPECT_EQ(w->wait(30), 0) << c.logs();

  auto sched = read_json(c.run / "ps" / "scheduler.json");
  EXPECT_EQ(sched["failovers"].get<int64_t>(), 2);
  EXPECT_EQ(sched["backups_attached"].get<int64_t>(), 1);
  EXPECT_EQ(sched["rollbacks"].get<int64_t>(), 0);
  auto s0 = read_json(c.run / "ps" / "server_0.json");
  EXPECT_EQ(s0["snapshots_in"].get<int64_t>(), 1) << s0.dump();
  EXPECT_GE(s0["updates_replicated_in"].get<int64_t>(), 5) << s0.dump();
  EXPECT_EQ(s0["updates"].get<int64_t>(), kSteps);
  // Each killed primary may die between applying an update (and streaming it to its backup) and
  // appending that update's line to metrics.jsonl: at most one line per kill is missing.
  EXPECT_GE(applied_steps(c.run), kSteps - 2);
  EXPECT_LE(applied_steps(c.run), kSteps);
  expect_reference_params(c.run);
}

// The scheduler killed mid-run: every node finds it silent, registers with the standby (started
// up front, its address given to every node) as the node it was, and the standby runs the job to
// its end. The scheduler is not on the data path, so sync training is undisturbed: bitwise the
// reference parameters.
TEST_F(PsServerFault, StandbySchedulerTakesOverAKilledScheduler) {
  const fs::path dir = tmp_->path();
  const std::string name = "standby";
  write_corpus(dir / "data", 60000);
  const std::string keys = (dir / "standby_keys").string();
  Process({"ps", "keygen", keys}, dir / "standby_keygen.log").wait(30);
  std::vector<std::string> common = {"--keys",
                                     keys,
                                     "--workers",
                                     "2",
                                     "--servers",
                                     "2",
                                     "--heartbeat-interval",
                                     "0.1",
                                     "--heartbeat-timeout",
                                     "1"};
  for (const auto& s : as_set_args(tiny_ps_overrides(dir / "data", dir / name, kSteps, 2)))
    common.push_back(s);
  auto scheduler_args = [&](const std::string& which, bool standby) {
    std::vector<std::string> a = {"ps",
                                  "scheduler",
                                  "--scheduler",
                                  "tcp://127.0.0.1:*",
                                  "--endpoint-file",
                                  (dir / (which + ".endpoint")).string()};
    if (standby) a.push_back("--standby");
    a.insert(a.end(), common.begin(), common.end());
    return a;
  };
  Process first(scheduler_args("first", false), dir / "standby_first.log");
  Process second(scheduler_args("second", true), dir / "standby_second.log");
  ASSERT_TRUE(wait_for_file(dir / "first.endpoint", 30));
  ASSERT_TRUE(wait_for_file(dir / "second.endpoint", 30));
  std::string ep1, ep2;
  std::ifstream(dir / "first.endpoint") >> ep1;
  std::ifstream(dir / "second.endpoint") >> ep2;
  std::vector<std::unique_ptr<Process>> nodes;
  for (int s = 0; s < 2; ++s)
    nodes.push_back(std::make_unique<Process>(
        std::vector<std::string>{"ps", "server", "--scheduler", ep1, "--standby-scheduler", ep2,
                                 "--keys", keys},
        dir / ("standby_server" + std::to_string(s) + ".log")));
  for (int w = 0; w < 2; ++w)
    nodes.push_back(std::make_unique<Process>(
        std::vector<std::string>{"ps", "worker", "--scheduler", ep1, "--standby-scheduler", ep2,
                                 "--keys", keys, "--index", std::to_string(w), "--slowdown",
                                 w == 1 ? "30" : "1"},
        dir / ("standby_worker" + std::to_string(w) + ".log")));
  auto logs = [&] {
    std::string out = "scheduler:\n" + first.output() + "standby:\n" + second.output();
    for (auto& n : nodes) out += "node:\n" + n->output();
    return out;
  };
  const fs::path run = dir / name;
  ASSERT_TRUE(wait_until([&] { return applied_steps(run) >= 20; }, 60)) << logs();
  first.kill(SIGKILL);
  ASSERT_LT(applied_steps(run), kSteps) << "the job ended before the kill";
  // Training goes on without a scheduler; the standby takes over while it still runs (worker 1
  // at --slowdown 30 keeps the run long enough) and then ends it.
  ASSERT_TRUE(wait_until(
      [&] { return second.output().find("the standby takes over") != std::string::npos; }, 30))
      << logs();
  EXPECT_LT(applied_steps(run), kSteps) << "the takeover came after the last clock";
  ASSERT_EQ(second.wait(150), 0) << logs();
  for (auto& n : nodes) EXPECT_EQ(n->wait(30), 0) << logs();
  EXPECT_EQ(applied_steps(run), kSteps) << "every clock applied exactly once";
  expect_reference_params(run);
}

TEST_F(PsServerFault, RestartedServerRestoresItsCheckpointAndTheJobRollsBack) {
  Cluster c(tmp_->path(), "restart", 2, kSteps, 2, {"--servers", "2", "--checkpoint-every", "10"},
            "2");
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 35; }, 60)) << c.logs();
  Process* victim = c.find("server", 1);
  ASSERT_NE(victim, nullptr) << c.logs();
  victim->kill(SIGKILL);
  const int64_t at_kill = applied_steps(c.run);
  ASSERT_LT(at_kill, kSteps) << "the job ended before the kill";
  // Restarted by hand once the scheduler noticed (2 s heartbeat timeout) and waits for it.
  ASSERT_TRUE(wait_until(
      [&] { return c.scheduler->output().find("waiting up to") != std::string::npos; }, 30))
      << c.logs();
  c.add_server();
  ASSERT_EQ(c.scheduler->wait(150), 0) << c.logs();
  for (auto& w : c.workers) EXPECT_EQ(w->wait(30), 0) << c.logs();

  auto sched = read_json(c.run / "ps" / "scheduler.json");
  EXPECT_EQ(sched["rollbacks"].get<int64_t>(), 1);
  EXPECT_EQ(read_json(c.run / "ps" / "server_1.json")["rollbacks"].get<int64_t>(), 1);
  // The roll-back went to a checkpointed clock at most 10 clocks (plus the one in flight) back.
  int64_t rollback = -1;
  for (const auto& j : read_metrics(c.run))
    if (j.contains("rollback_to")) rollback = j["rollback_to"].get<int64_t>();
  EXPECT_EQ(rollback % 10, 0);
  EXPECT_GE(rollback, 30);
  EXPECT_LE(rollback, at_kill + 1);
  // Only the newest three checkpoints of each server are kept.
  for (int s = 0; s < 2; ++s) {
    const fs::path d = c.run / "ps" / ("server_" + std::to_string(s));
    const auto files = std::distance(fs::directory_iterator(d), fs::directory_iterator());
    EXPECT_EQ(files, 3) << d;
  }
  expect_reference_params(c.run);
}

// `ps launch` restarts a server that died; the job rolls back and completes as undisturbed.
TEST_F(PsServerFault, LaunchRestartsAKilledServer) {
  const fs::path run = tmp_->path() / "launch";
  std::vector<std::string> args = {"ps",
                                   "launch",
                                   "--timeout",
                                   "150",
                                   "--servers",
                                   "2",
                                   "--workers",
                                   "2",
                                   "--checkpoint-every",
                                   "10",
                                   "--heartbeat-interval",
                                   "0.1",
                                   "--heartbeat-timeout",
                                   "1",
                                   "--",
                                   "train"};
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp_->path() / "data", run, kSteps, 2)))
    args.push_back(s);
  Process job(args, tmp_->path() / "launch.log");
  ASSERT_TRUE(wait_until([&] { return applied_steps(run) >= 35; }, 60)) << job.output();
  pid_t victim = -1;
  const auto job_json = read_json(run / "ps" / "job.json");
  for (const auto& n : job_json["nodes"])
    if (n["role"] == "server" && n["index"] == 0) victim = n["pid"].get<pid_t>();
  ASSERT_GT(victim, 0) << job_json.dump();
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ASSERT_EQ(job.wait(150), 0) << job.output();
  EXPECT_NE(job.output().find("restarting server"), std::string::npos) << job.output();
  EXPECT_EQ(read_json(run / "ps" / "scheduler.json")["rollbacks"].get<int64_t>(), 1);
  expect_reference_params(run);
}

// `ps launch --standby-scheduler` starts the standby and gives its address to every node; a spare
// server comes along (`--spare-servers 1`) and waits unused. The scheduler launch started is
// killed mid-run (its pid from RUN_DIR/ps/launch.json): launch does not stop the job, the standby
// takes over, launch waits for the workers and exits 0, and the parameters are bitwise the
// undisturbed run's, as in StandbySchedulerTakesOverAKilledScheduler.
TEST_F(PsServerFault, LaunchedStandbySchedulerTakesOverAKilledScheduler) {
  const fs::path run = tmp_->path() / "launch_standby";
  std::vector<std::string> args = {"ps",
                                   "launch",
                                   "--timeout",
                                   "150",
                                   "--servers",
                                   "2",
                                   "--workers",
                                   "2",
                                   "--standby-scheduler",
                                   "--spare-servers",
                                   "1",
                                   "--heartbeat-interval",
                                   "0.1",
                                   "--heartbeat-timeout",
                                   "1",
                                   "--slowdown",
                                   "1=30",
                                   "--",
                                   "train"};
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp_->path() / "data", run, kSteps, 2)))
    args.push_back(s);
  Process job(args, tmp_->path() / "launch_standby.log");
  ASSERT_TRUE(wait_until([&] { return applied_steps(run) >= 20; }, 60)) << job.output();
  pid_t scheduler = -1, standby = -1;
  const auto pids = read_json(run / "ps" / "launch.json");
  for (const auto& p : pids["processes"]) {
    if (p["name"] == "scheduler") scheduler = p["pid"].get<pid_t>();
    if (p["name"] == "standby scheduler") standby = p["pid"].get<pid_t>();
  }
  ASSERT_GT(scheduler, 0) << pids.dump();
  ASSERT_GT(standby, 0) << pids.dump();
  EXPECT_EQ(pids["processes"].size(), 7u)
      << "2 schedulers, 2 servers, 1 spare, 2 workers: " << pids.dump();
  ASSERT_EQ(::kill(scheduler, SIGKILL), 0);
  ASSERT_LT(applied_steps(run), kSteps) << "the job ended before the kill";
  ASSERT_TRUE(wait_until(
      [&] { return job.output().find("the standby takes over") != std::string::npos; }, 30))
      << job.output();
  EXPECT_LT(applied_steps(run), kSteps) << "the takeover came after the last clock";
  ASSERT_EQ(job.wait(150), 0) << job.output();
  const std::string out = job.output();
  EXPECT_NE(out.find("the standby scheduler (pid " + std::to_string(standby)), std::string::npos)
      << out;
  EXPECT_NE(out.find("waiting as a spare"), std::string::npos) << out;
  int spares = 0;
  for (std::size_t at = 0; (at = out.find("(spare) registered", at)) != std::string::npos; ++at)
    ++spares;
  EXPECT_EQ(spares, 1) << out;
  EXPECT_EQ(applied_steps(run), kSteps) << "every clock applied exactly once";
  expect_reference_params(run);
}

// optim.grad_clip over two servers through server failures: each sync update waits for the
// scheduler's global scale (ps/global_norm.h). A killed primary's backup, promoted, reports the
// clock in flight again and gets the decided (or the completed) round; without a replica, the
// surviving server waiting on the dead one's partial gives the update up when the roll-back
// begins. Either way the job ends with bitwise the undisturbed clipped run's parameters (the
// same partials, summed in the same order, give the same scale), and nothing hangs.
TEST(PsServerFaultClip, FailuresKeepTheGloballyClippedRunsBits) {
  TempDir tmp("ps_fault_clip");
  const int steps = 80;
  const std::vector<std::string> clip = {"optim.grad_clip=0.05"};
  std::vector<float> reference;
  {
    Cluster c(tmp.path(), "ref", 2, steps, 2, {"--servers", "2"}, "2", 1.0, clip);
    ASSERT_EQ(c.scheduler->wait(150), 0) << c.logs();
    reference = load_model(c.run).params;
    int clipped = 0;
    for (const auto& j : read_metrics(c.run))
      if (j.contains("clip_scale")) clipped += j["clip_scale"].get<double>() < 1.0;
    EXPECT_GE(clipped, steps / 2) << "the threshold should clip most steps";
  }
  {
    Cluster c(tmp.path(), "replica", 2, steps, 4, {"--servers", "2", "--server-replicas", "2"},
              "2", 1.0, clip);
    ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 20; }, 60)) << c.logs();
    Process* primary = c.find("server", 0, true);
    ASSERT_NE(primary, nullptr) << c.logs();
    primary->kill(SIGKILL);
    ASSERT_LT(applied_steps(c.run), steps) << "the job ended before the kill";
    ASSERT_EQ(c.scheduler->wait(150), 0) << c.logs();
    EXPECT_EQ(read_json(c.run / "ps" / "scheduler.json")["failovers"].get<int64_t>(), 1);
    EXPECT_EQ(load_model(c.run).params, reference) << "the promoted backup's job";
  }
  {
    Cluster c(tmp.path(), "restart", 2, steps, 2, {"--servers", "2", "--checkpoint-every", "10"},
              "2", 1.0, clip);
    ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 25; }, 60)) << c.logs();
    Process* victim = c.find("server", 1);
    ASSERT_NE(victim, nullptr) << c.logs();
    victim->kill(SIGKILL);
    ASSERT_LT(applied_steps(c.run), steps) << "the job ended before the kill";
    ASSERT_TRUE(wait_until(
        [&] { return c.scheduler->output().find("waiting up to") != std::string::npos; }, 30))
        << c.logs();
    c.add_server();
    ASSERT_EQ(c.scheduler->wait(150), 0) << c.logs();
    EXPECT_EQ(read_json(c.run / "ps" / "scheduler.json")["rollbacks"].get<int64_t>(), 1);
    EXPECT_EQ(load_model(c.run).params, reference) << "the rolled-back job";
  }
}

// A job of `sets` over two servers through server failures ends with bitwise the undisturbed
// job's parameters: server 0's primary killed (its backup promoted), or server 1 killed and the
// job rolled back to a checkpoint. `check` looks at the undisturbed run.
void expect_failures_keep_the_bits(const std::string& name, const std::vector<std::string>& sets,
                                   const std::function<void(const fs::path&)>& check) {
  TempDir tmp(name);
  const int steps = 60;
  std::vector<float> reference;
  {
    Cluster c(tmp.path(), "ref", 2, steps, 2, {"--servers", "2"}, "2", 1.0, sets);
    ASSERT_EQ(c.scheduler->wait(150), 0) << c.logs();
    reference = load_model(c.run).params;
    check(c.run);
  }
  {
    Cluster c(tmp.path(), "replica", 2, steps, 4, {"--servers", "2", "--server-replicas", "2"},
              "2", 1.0, sets);
    ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 20; }, 60)) << c.logs();
    Process* primary = c.find("server", 0, true);
    ASSERT_NE(primary, nullptr) << c.logs();
    primary->kill(SIGKILL);
    ASSERT_LT(applied_steps(c.run), steps) << "the job ended before the kill";
    ASSERT_EQ(c.scheduler->wait(150), 0) << c.logs();
    EXPECT_EQ(read_json(c.run / "ps" / "scheduler.json")["failovers"].get<int64_t>(), 1);
    EXPECT_GE(read_json(c.run / "ps" / "server_0.json")["updates_replicated_in"].get<int64_t>(),
              19);
    EXPECT_EQ(load_model(c.run).params, reference) << "the promoted backup's job";
  }
  {
    Cluster c(tmp.path(), "restart", 2, steps, 2, {"--servers", "2", "--checkpoint-every", "10"},
              "2", 1.0, sets);
    ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 25; }, 60)) << c.logs();
    Process* victim = c.find("server", 1);
    ASSERT_NE(victim, nullptr) << c.logs();
    victim->kill(SIGKILL);
    ASSERT_LT(applied_steps(c.run), steps) << "the job ended before the kill";
    ASSERT_TRUE(wait_until(
        [&] { return c.scheduler->output().find("waiting up to") != std::string::npos; }, 30))
        << c.logs();
    c.add_server();
    ASSERT_EQ(c.scheduler->wait(150), 0) << c.logs();
    EXPECT_EQ(read_json(c.run / "ps" / "scheduler.json")["rollbacks"].get<int64_t>(), 1);
    EXPECT_EQ(load_model(c.run).params, reference) << "the rolled-back job";
  }
}

// grad.sparse_experts: the experts round gives every server the clock's mask, and a primary
// streams each update's mask to its backup with the summed gradient, so the backup's replay steps
// around the same frozen experts (a zero gradient would still move AdamW's moments and weight
// decay). Server 0's backup holds no count keys: the mask it replays with is the streamed one.
TEST(PsServerFaultSparse, FailuresKeepTheSparseExpertRunsBits) {
  expect_failures_keep_the_bits(
      "ps_fault_sparse",
      {"model.n_experts=16", "model.top_k=1", "train.grad_accum=2", "grad.sparse_experts=true",
       "grad.min_accum_fraction=1"},
      [](const fs::path& run) {
        int64_t frozen = 0;
        for (const auto& j : read_metrics(run))
          if (j.contains("experts_frozen")) frozen += j["experts_frozen"].get<int64_t>();
        EXPECT_GT(frozen, 0) << "the configuration should freeze experts";
      });
}

// grad.expert_reweight = importance: its moving averages travel with every server checkpoint
// (restored on a roll-back), with each replicated update (a backup's replay of the reweighted
// sum computes none) and with a snapshot to a new backup. A promoted backup, or a roll-back,
// whose averages were stale would give other factors from then on, and other bits.
TEST(PsServerFaultImportance, FailuresKeepTheImportanceReweightedRunsBits) {
  expect_failures_keep_the_bits("ps_fault_importance",
                                {"grad.expert_reweight=importance", "optim.grad_clip=0.05"},
                                [](const fs::path&) {});
}

}  // namespace
