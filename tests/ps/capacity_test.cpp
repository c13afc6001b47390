// The dynamic capacity controller (model.capacity = dynamic) in a sync parameter-server job, run
// by the scheduler (ps/capacity_rounds.h): real processes of the built binary over real ZeroMQ,
// against the single-process run over the same micro-batches.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <csignal>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "io/metrics.h"
#include "ps/options.h"
#include "ps/group_job.h"  // tests/ps/group_job.h
#include "ps/process.h"  // tests/ps/process.h
#include "support/corpus.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int kWorkers = 2, kRows = 2;  // rows per worker

// A controller that moves: the factor starts at 1 (capacity ≈ the mean load, so the experts
// drop tokens), grows while the slots are full (utilisation above 0.8, any imbalance up to 3),
// and the trend rule over a window of 4 shrinks it again once the utilisation falls.
const std::vector<std::string> kDynamic = {
    "model.capacity=dynamic", "model.capacity_factor=1.0", "balance.window=4",
    "balance.util_high=0.8",  "balance.imbalance_low=3",  "balance.imbalance_high=3",
    "balance.slope_tol=0.005"};

std::vector<std::string> launch_args(const TempDir& tmp, const std::vector<std::string>& ps_args,
                                     int steps, const std::string& run) {
  write_corpus(tmp / "data", 60000);
  std::vector<std::string> args = {"ps", "launch", "--timeout", "150"};
  args.insert(args.end(), ps_args.begin(), ps_args.end());
  args.insert(args.end(), {"--", "train"});
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp / "data", tmp / run, steps, kRows)))
    args.push_back(s);
  for (const auto& s : as_set_args(kDynamic)) args.push_back(s);
  return args;
}

std::map<int64_t, double> losses(const fs::path& run) {
  std::map<int64_t, double> out;
  for (const auto& j : read_metrics(run))
    if (j.contains("loss")) out[j["step"].get<int64_t>()] = j["loss"].get<double>();
  return out;
}

// The scheduler's record: clock → its line (a later line of a clock replaces an earlier one).
std::map<int64_t, nlohmann::json> capacity_record(const fs::path& run) {
  std::map<int64_t, nlohmann::json> out;
  for (const auto& j : read_metrics_file(run / "metrics" / "scheduler.jsonl"))
    if (j.contains("capacity_rule")) out[j["clock"].get<int64_t>()] = j;
  return out;
}

// The single-process run over the same micro-batches: each of the W workers routes its B rows in
// one forward, with a capacity from B·T tokens; `train` with batch_size = B and grad_accum = W
// routes micro-batch m, the rows worker m reads (data/loader.h: stream_position), in a forward of
// its own with the same capacity, and sums the same integers over the micro-batches that the
// scheduler sums over the workers (train/accumulate.cpp).
std::vector<float> reference_run(const TempDir& tmp, int steps) {
  std::vector<std::string> sets = tiny_ps_overrides(tmp / "data", tmp / "ref", steps, kRows);
  sets.push_back("train.grad_accum=" + std::to_string(kWorkers));
  sets.insert(sets.end(), kDynamic.begin(), kDynamic.end());
  Trainer t(load_run_config("", sets), false);
  t.run();
  return t.params();
}

// The sync job's factors are the single-process run's, step by step and bitwise: both sum the
// same integer figures (exact) and feed them to the same controller, so they stay equal as long as
// every token is routed alike. The losses and parameters differ only by the order of the
// gradient sums (the server adds the workers' gradients, the single process accumulates the
// micro-batches' in one buffer): about 1e-7 relative per step, so 1e-5 after 16 steps, as
// PsJob.SyncEqualsSingleProcess bounds it. A worker that ignored the factors would drop other
// tokens and move the losses by far more (the reference drops tokens at some steps).
TEST(PsCapacity, SyncControllerFollowsTheSingleProcessRun) {
  TempDir tmp("ps_capacity");
  const int steps = 16;
  Process p(launch_args(tmp, {"--servers", "1", "--workers", "2"}, steps, "run"),
            tmp / "run.log");
  ASSERT_EQ(p.wait(180), 0) << p.output();
  const std::vector<float> ref_params = reference_run(tmp, steps);

  std::map<int64_t, nlohmann::json> ref;
  for (const auto& j : read_metrics(tmp / "ref"))
    if (j.contains("capacity_factor")) ref[j["step"].get<int64_t>()] = j;
  ASSERT_EQ(ref.size(), static_cast<std::size_t>(steps));
  const auto record = capacity_record(tmp / "run");
  ASSERT_EQ(record.size(), static_cast<std::size_t>(steps));
  bool moved = false, dropped = false;
  for (int c = 0; c < steps; ++c) {
    const nlohmann::json& r = ref.at(c + 1);  // `train`'s line of step c + 1 is clock c's
    const nlohmann::json& s = record.at(c);
    EXPECT_EQ(s["capacity_factor"].get<std::vector<double>>(),
              r["capacity_factor"].get<std::vector<double>>())
        << "clock " << c;
    EXPECT_EQ(s["capacity_utilisation"].get<std::vector<double>>(),
              r["capacity_utilisation"].get<std::vector<double>>())
        << "clock " << c;
    moved = moved || r["capacity_factor"] != ref.at(1)["capacity_factor"];
    for (double d : r["dropped_fraction"].get<std::vector<double>>()) dropped = dropped || d > 0;
  }
  EXPECT_TRUE(moved) << "the reference's factor never moved: the test would not see a worker "
                        "that ignores the scheduler's factors";
  EXPECT_TRUE(dropped) << "the reference never dropped a token";

  auto a = losses(tmp / "run"), b = losses(tmp / "ref");
  ASSERT_EQ(a.size(), static_cast<std::size_t>(steps));
  for (auto [step, loss] : b) EXPECT_LE(std::fabs(a.at(step) - loss), 1e-5 * std::fabs(loss));
  LoadedModel m = load_model(tmp / "run");
  EXPECT_EQ(m.step, steps);
  ASSERT_EQ(m.params.size(), ref_params.size());
  EXPECT_LE(relative_l2(m.params, ref_params), 1e-5);
}

// A job stopped by SIGTERM and resumed rebuilds the controllers from the scheduler's record: the
// factors of every clock and the final parameters are bitwise the uninterrupted job's (sync
// replays the same clocks from the same state).
TEST(PsCapacity, ResumedJobKeepsTheControllersState) {
  TempDir tmp("ps_capacity_resume");
  const int steps = 24;
  const std::vector<std::string> opts = {"--servers", "1", "--workers", "2", "--slowdown", "0=4"};
  {
    Process whole(launch_args(tmp, opts, steps, "whole"), tmp / "whole.log");
    ASSERT_EQ(whole.wait(180), 0) << whole.output();
  }
  std::vector<std::string> args = launch_args(tmp, opts, steps, "run");
  {
    Process p(args, tmp / "stopped.log");
    ASSERT_TRUE(wait_until([&] { return !p.running() || losses(tmp / "run").size() >= 8; }, 120));
    ASSERT_TRUE(p.running()) << p.output();
    p.kill(SIGTERM);
    ASSERT_EQ(p.wait(120), 143) << p.output();
  }
  ASSERT_LT(losses(tmp / "run").rbegin()->first, steps);
  args.insert(args.begin() + 2, "--resume");
  Process r(args, tmp / "resumed.log");
  ASSERT_EQ(r.wait(150), 0) << r.output();

  const auto x = capacity_record(tmp / "run"), y = capacity_record(tmp / "whole");
  ASSERT_EQ(y.size(), static_cast<std::size_t>(steps));
  ASSERT_EQ(x.size(), y.size());
  for (const auto& [clock, line] : y) {
    EXPECT_EQ(x.at(clock)["capacity_factor"], line["capacity_factor"]) << "clock " << clock;
    EXPECT_EQ(x.at(clock)["capacity_rule"], line["capacity_rule"]) << "clock " << clock;
  }
  LoadedModel a = load_model(tmp / "run"), b = load_model(tmp / "whole");
  EXPECT_EQ(a.step, steps);
  EXPECT_EQ(a.params, b.params);
}

// A standby scheduler that takes over a killed scheduler rebuilds the controllers from the
// record in metrics/scheduler.jsonl: every clock's factors are still bitwise the single-process
// run's (as in SyncControllerFollowsTheSingleProcessRun), before the kill and after it.
TEST(PsCapacity, StandbySchedulerTakesOverTheControllers) {
  TempDir tmp("ps_capacity_standby");
  const int steps = 40;
  const fs::path run = tmp / "run";
  Process job(launch_args(tmp,
                          {"--servers", "1", "--workers", "2", "--standby-scheduler",
                           "--heartbeat-interval", "0.1", "--heartbeat-timeout", "1",
                           "--slowdown", "1=8"},
                          steps, "run"),
              tmp / "run.log");
  ASSERT_TRUE(wait_until([&] { return applied_steps(run) >= 10 || !job.running(); }, 60))
      << job.output();
  pid_t scheduler = -1;
  const nlohmann::json pids = read_json(run / "ps" / "launch.json");
  for (const auto& p : pids["processes"])
    if (p["name"] == "scheduler") scheduler = p["pid"].get<pid_t>();
  ASSERT_GT(scheduler, 0) << pids.dump();
  ASSERT_EQ(::kill(scheduler, SIGKILL), 0);
  ASSERT_LT(applied_steps(run), steps) << "the job ended before the kill";
  ASSERT_EQ(job.wait(150), 0) << job.output();
  EXPECT_NE(job.output().find("the standby takes over"), std::string::npos) << job.output();
  bool took_over = false;
  for (const auto& j : read_metrics_file(run / "metrics" / "scheduler.jsonl"))
    took_over = took_over || j.value("event", "") == "scheduler_takeover";
  EXPECT_TRUE(took_over);

  reference_run(tmp, steps);
  std::map<int64_t, nlohmann::json> ref;
  for (const auto& j : read_metrics(tmp / "ref"))
    if (j.contains("capacity_factor")) ref[j["step"].get<int64_t>()] = j;
  const auto record = capacity_record(run);
  ASSERT_EQ(record.size(), static_cast<std::size_t>(steps));
  for (const auto& [clock, line] : record)
    EXPECT_EQ(line["capacity_factor"].get<std::vector<double>>(),
              ref.at(clock + 1)["capacity_factor"].get<std::vector<double>>())
        << "clock " << clock;
}

// Without a standby the server elected in the dead scheduler's place rebuilds the controllers
// the same way.
TEST(PsCapacity, ElectedServerTakesOverTheControllers) {
  TempDir tmp("ps_capacity_elect");
  const int steps = 40;
  Cluster c(tmp.path(), "run", kWorkers, steps, 1, {}, "1", 8.0, kDynamic);
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 10; }, 60)) << c.logs();
  c.scheduler->kill(SIGKILL);
  ASSERT_LT(applied_steps(c.run), steps) << "the job ended before the kill";
  EXPECT_EQ(c.servers[0]->wait(150), 0) << c.logs();
  for (auto& w : c.workers) EXPECT_EQ(w->wait(30), 0) << c.logs();
  EXPECT_NE(c.servers[0]->output().find("server 0 (elected) takes over"), std::string::npos)
      << c.logs();

  reference_run(tmp, steps);
  std::map<int64_t, nlohmann::json> ref;
  for (const auto& j : read_metrics(tmp / "ref"))
    if (j.contains("capacity_factor")) ref[j["step"].get<int64_t>()] = j;
  const auto record = capacity_record(c.run);
  ASSERT_EQ(record.size(), static_cast<std::size_t>(steps));
  for (const auto& [clock, line] : record)
    EXPECT_EQ(line["capacity_factor"].get<std::vector<double>>(),
              ref.at(clock + 1)["capacity_factor"].get<std::vector<double>>())
        << "clock " << clock;
}

// A server killed without a replica: the job rolls back to the newest checkpoint, and the
// controllers with it (replayed from the record to that clock), so the replayed clocks run with
// the factors they had, and every clock's factors are still the single-process run's.
TEST(PsCapacity, RollBackToAServerCheckpointRewindsTheControllers) {
  TempDir tmp("ps_capacity_rollback");
  const int steps = 40;
  Cluster c(tmp.path(), "run", kWorkers, steps, 2, {"--servers", "2", "--checkpoint-every", "10"},
            "1", 8.0, kDynamic);
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 15; }, 60)) << c.logs();
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
  int64_t lines = 0;
  for (const auto& j : read_metrics_file(c.run / "metrics" / "scheduler.jsonl"))
    lines += j.contains("capacity_rule");
  EXPECT_GT(lines, steps) << "no clock was decided twice: the roll-back undid none";

  reference_run(tmp, steps);
  std::map<int64_t, nlohmann::json> ref;
  for (const auto& j : read_metrics(tmp / "ref"))
    if (j.contains("capacity_factor")) ref[j["step"].get<int64_t>()] = j;
  const auto record = capacity_record(c.run);
  ASSERT_EQ(record.size(), static_cast<std::size_t>(steps));
  for (const auto& [clock, line] : record)
    EXPECT_EQ(line["capacity_factor"].get<std::vector<double>>(),
              ref.at(clock + 1)["capacity_factor"].get<std::vector<double>>())
        << "clock " << clock;
}

// The modes whose clocks have no set of workers to sum over stay refused, naming the mode and
// why; sync is accepted, also for a worker group.
TEST(PsCapacity, ModesWithoutAClockOfEveryWorkerAreRefused) {
  TempDir tmp("ps_capacity_refused");
  std::vector<std::string> sets = tiny_ps_overrides(tmp / "data", tmp / "run", 4, kRows);
  sets.insert(sets.end(), kDynamic.begin(), kDynamic.end());
  const RunConfig cfg = load_run_config("", sets);
  ps::PsOptions o;
  o.workers = 2;
  EXPECT_NO_THROW(ps::check_ps_run_config(cfg, o));
  for (const char* mode : {"quorum", "async", "ssp", "half_sync", "average"}) {
    o.consistency = mode;
    try {
      ps::check_ps_run_config(cfg, o);
      ADD_FAILURE() << mode << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("model.capacity = dynamic with "
                                                       "--consistency ") +
                                           mode),
                std::string::npos)
          << e.what();
    }
  }
  o.consistency = "sync";
  EXPECT_NO_THROW(ps::check_worker_group(cfg, o, 2));
}

// A worker group of EP 2 under the controller: each rank is a worker of the scheduler's round and
// reports the figures of its own tokens, which the scheduler sums (integers) as `train` under
// mpiexec with dist.ep = 2 sums its ranks' (train/step_metrics.cpp reduce_step_figures); both
// feed the same controller, every rank takes the same factors before the clock, and the group's
// gradients are the collective run's (PsGroup.OneGroupEndsBitwiseWhereTheCollectiveRunEnds). So
// every clock's factor and utilisation and the final parameters are bitwise the collective run's.
TEST(PsCapacity, AWorkerGroupFollowsTheCollectiveRunBitwise) {
  TempDir tmp("ps_capacity_group");
  const int steps = 12;
  GroupJob job(tmp.path(), "run", 1, 2, steps, kRows, kDynamic, 1);
  ASSERT_EQ(job.wait(150), 0) << job.logs();
  const CollectiveRun mpi = collective_run(tmp.path(), "mpi", 2, steps, kRows, kDynamic);
  ASSERT_EQ(mpi.code, 0) << mpi.output;

  std::map<int64_t, nlohmann::json> ref;
  for (const auto& j : read_metrics(tmp / "mpi"))
    if (j.contains("capacity_factor")) ref[j["step"].get<int64_t>()] = j;
  ASSERT_EQ(ref.size(), static_cast<std::size_t>(steps));
  const auto record = capacity_record(job.run);
  ASSERT_EQ(record.size(), static_cast<std::size_t>(steps));
  bool moved = false;
  for (int c = 0; c < steps; ++c) {
    const nlohmann::json& r = ref.at(c + 1);
    const nlohmann::json& s = record.at(c);
    EXPECT_EQ(s["capacity_factor"].get<std::vector<double>>(),
              r["capacity_factor"].get<std::vector<double>>())
        << "clock " << c;
    EXPECT_EQ(s["capacity_utilisation"].get<std::vector<double>>(),
              r["capacity_utilisation"].get<std::vector<double>>())
        << "clock " << c;
    moved = moved || r["capacity_factor"] != ref.at(1)["capacity_factor"];
  }
  EXPECT_TRUE(moved) << "the collective run's factor never moved";
  const std::vector<float> a = load_model(job.run).params, b = load_model(tmp / "mpi").params;
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(values_differing(a, b), 0) << "of " << a.size() << " parameters differ";
}

}  // namespace
