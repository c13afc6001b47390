// A worker group through a server's death and the roll-back to the servers' checkpoint: every
// rank of the group goes back to the pull together (the ranks agree on the roll-back), and the
// replay of a sync job is exact.
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "io/metrics.h"
#include "ps/group_job.h"  // tests/ps/group_job.h
#include "ps/process.h"    // tests/ps/process.h
#include "support/temp_dir.h"
#include "train/lm_checkpoint.h"

using namespace moetrain;
using namespace moetrain::testing;

TEST(PsGroupFault, AGroupRollsBackTogetherAndEndsAsTheUndisturbedJob) {
  TempDir tmp("ps_group_fault");
  const int steps = 40, batch = 2;
  const std::vector<std::string> job = {"--checkpoint-every", "10"};
  // Each step paced to a few times its compute, so that the kill lands mid-job.
  GroupJob ref(tmp.path(), "ref", 1, 2, steps, batch, {}, 2, job, "1", 4.0);
  ASSERT_EQ(ref.wait(150), 0) << ref.logs();
  GroupJob c(tmp.path(), "run", 1, 2, steps, batch, {}, 2, job, "1", 4.0);
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 15; }, 60)) << c.logs();
  c.servers[1]->kill(SIGKILL);
  ASSERT_LT(applied_steps(c.run), steps) << "the job ended before the kill";
  ASSERT_TRUE(wait_until(
      [&] { return c.scheduler->output().find("waiting up to") != std::string::npos; }, 30))
      << c.logs();
  c.add_server();
  ASSERT_EQ(c.wait(150), 0) << c.logs();
  EXPECT_EQ(read_json(c.run / "ps" / "scheduler.json")["rollbacks"].get<int64_t>(), 1)
      << c.logs();
  const std::vector<float> a = load_model(c.run).params, b = load_model(ref.run).params;
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(values_differing(a, b), 0) << "parameters differ from the undisturbed group job's";
}

namespace {

// The processes whose parent is `parent` (a group's mpiexec forks its ranks on this machine).
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "stat");
    std::string stat;
    std::getline(in, stat);
    // pid (comm) state ppid ...: the command may hold spaces, so read after its closing ')'.
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(static_cast<pid_t>(std::stol(name)));
  }
  return out;
}

}  // namespace

// kill -9 of one rank of a worker group: MPI takes the group's other rank down with it, the
// scheduler loses both workers and sync goes on with the other group; a new group started in its
// place (the same indices) pulls the servers' state, its ranks agree on the clock to join at, and
// the job finishes every clock once. Not bitwise against the undisturbed job (the lost group's
// rows go to the other group meanwhile), so its validation loss is held near the undisturbed
// one's, as PsFault.KilledWorkerIsReplacedAndTheRunCompletes holds a replica worker's.
TEST(PsGroupFault, AKilledRankTakesItsGroupDownAndARestartedGroupFinishesTheJob) {
  TempDir tmp("ps_group_kill");
  const int steps = 200, batch = 2;
  GroupJob ref(tmp.path(), "ref", 2, 2, steps, batch, {}, 1, {}, "1", 3.0);
  ASSERT_EQ(ref.wait(150), 0) << ref.logs();
  GroupJob c(tmp.path(), "run", 2, 2, steps, batch, {}, 1, {}, "1", 3.0);
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 15; }, 60)) << c.logs();
  const std::vector<pid_t> ranks = children_of(c.groups[1]->pid());
  ASSERT_EQ(ranks.size(), 2u) << "group 1's mpiexec should have forked its two ranks";
  ::kill(ranks[1], SIGKILL);
  const int64_t at_kill = applied_steps(c.run);
  ASSERT_LT(at_kill, steps) << "the job ended before the kill";
  // The group's launcher ends (MPI aborts the job of a rank that died), then group 0 goes on.
  ASSERT_TRUE(wait_until([&] { return !c.groups[1]->running(); }, 30)) << c.logs();
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= at_kill + 5; }, 60)) << c.logs();
  ASSERT_LT(applied_steps(c.run), steps) << "the job ended before the group came back";
  c.add_group(1);
  ASSERT_EQ(c.wait(150), 0) << c.logs();
  EXPECT_EQ(c.groups.back()->wait(30), 0) << c.logs();
  const auto sched = read_json(c.run / "ps" / "scheduler.json");
  EXPECT_EQ(sched["workers_lost"].get<int64_t>(), 2) << c.logs();
  EXPECT_EQ(sched["workers_joined"].get<int64_t>(), 2) << c.logs();
  EXPECT_EQ(applied_steps(c.run), steps);  // no clock lost or repeated
  const double a = val_loss(c.run), b = val_loss(ref.run);
  EXPECT_GT(a, 0);
  EXPECT_NEAR(a, b, 0.1) << "disturbed " << a << " vs undisturbed " << b;
}

// The same through `ps launch --group-size 2`: the launcher sees the group's mpirun end and starts
// the group again (at most three times), and the job completes with every clock once.
TEST(PsGroupFault, LaunchRestartsAGroupWhoseRankWasKilled) {
  TempDir tmp("ps_group_launch_kill");
  const int steps = 400, batch = 2;
  write_corpus(tmp / "data", 60000);
  std::vector<std::string> args = {"ps", "launch", "--timeout", "150", "--insecure", "--servers",
                                   "1", "--workers", "4", "--group-size", "2",
                                   "--heartbeat-timeout", "1", "--heartbeat-interval", "0.1",
                                   "--mpi-arg=--allow-run-as-root", "--mpi-arg=--oversubscribe",
                                   "--", "train"};
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp / "data", tmp / "run", steps, batch)))
    args.push_back(s);
  Process p(args, tmp / "launch.log");
  const std::filesystem::path run = tmp / "run";
  ASSERT_TRUE(wait_until([&] { return applied_steps(run) >= 20; }, 60)) << p.output();
  pid_t group1 = 0;
  const auto launched = read_json(run / "ps" / "launch.json");
  for (const auto& c : launched["processes"])
    if (c["name"] == "worker group 1") group1 = c["pid"].get<pid_t>();
  ASSERT_GT(group1, 0) << launched.dump();
  const std::vector<pid_t> ranks = children_of(group1);
  ASSERT_EQ(ranks.size(), 2u);
  ::kill(ranks[0], SIGKILL);
  ASSERT_LT(applied_steps(run), steps) << "the job ended before the kill";
  ASSERT_EQ(p.wait(150), 0) << p.output();
  EXPECT_NE(p.output().find("restarting worker group 1 (restart 1 of at most 3)"),
            std::string::npos)
      << p.output();
  const auto sched = read_json(run / "ps" / "scheduler.json");
  EXPECT_EQ(sched["workers_lost"].get<int64_t>(), 2) << p.output();
  EXPECT_EQ(sched["workers_joined"].get<int64_t>(), 2) << p.output();
  EXPECT_EQ(applied_steps(run), steps);
}
