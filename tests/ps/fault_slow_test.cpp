// Failures of real processes: a worker killed with SIGKILL mid-run is detected by its missing
// heartbeats and the sync job goes on with the others (its rows handed over); a restarted worker
// rejoins at the current clock; a killed scheduler ends every node with a clear message.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "ps/process.h"  // tests/ps/process.h
#include "support/corpus.h"
#include "support/temp_dir.h"

using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

struct Cluster {
  TempDir& tmp;
  fs::path run;
  std::string endpoint;
  std::unique_ptr<Process> scheduler, server;
  std::vector<std::unique_ptr<Process>> workers;

  Cluster(TempDir& t, const std::string& name, int n_workers, int steps)
      : tmp(t), run(t / name) {
    write_corpus(tmp / "data", 60000);
    std::vector<std::string> args = {"ps", "scheduler", "--scheduler", "tcp://127.0.0.1:*",
                                     "--endpoint-file", (tmp / (name + ".endpoint")).string(),
                                     "--workers", std::to_string(n_workers),
                                     "--heartbeat-interval", "0.1", "--heartbeat-timeout", "1"};
    for (const auto& s : as_set_args(tiny_ps_overrides(tmp / "data", run, steps, 2)))
      args.push_back(s);
    scheduler = std::make_unique<Process>(args, tmp / (name + "_scheduler.log"));
    EXPECT_TRUE(wait_for_file(tmp / (name + ".endpoint"), 30));
    std::ifstream(tmp / (name + ".endpoint")) >> endpoint;
    server = std::make_unique<Process>(
        std::vector<std::string>{"ps", "server", "--scheduler", endpoint},
        tmp / (name + "_server.log"));
    for (int w = 0; w < n_workers; ++w) add_worker(w, 1.0);
  }
  void add_worker(int index, double slowdown) {
    workers.push_back(std::make_unique<Process>(
        std::vector<std::string>{"ps", "worker", "--scheduler", endpoint, "--index",
                                 std::to_string(index), "--slowdown", std::to_string(slowdown)},
        tmp / fmt_name("worker", workers.size())));
  }
  static std::string fmt_name(const char* what, std::size_t i) {
    return std::string(what) + std::to_string(i) + ".log";
  }
  std::string logs() const {
    std::string out = "scheduler:\n" + scheduler->output() + "server:\n" + server->output();
    for (const auto& w : workers) out += "worker:\n" + w->output();
    return out;
  }
};

int64_t applied_steps(const fs::path& run) {
  int64_t n = 0;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) n += line.find("\"loss\"") != std::string::npos;
  return n;
}

double val_loss(const fs::path& run) {
  double v = -1;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) v = j["val_loss"].get<double>();
  }
  return v;
}

bool wait_until(const std::function<bool()>& cond, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!cond() && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return cond();
}

TEST(PsFault, KilledWorkerIsReplacedAndTheRunCompletes) {
  TempDir tmp("ps_fault");
  const int steps = 300;
  // The undisturbed run.
  {
    Cluster ref(tmp, "ref", 3, steps);
    ASSERT_EQ(ref.scheduler->wait(150), 0) << ref.logs();
  }
  Cluster c(tmp, "run", 3, steps);
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 20; }, 60)) << c.logs();
  c.workers[1]->kill(SIGKILL);
  const int64_t at_kill = applied_steps(c.run);
  // Detected within the heartbeat timeout (1 s), then sync goes on with two workers.
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= at_kill + 10; }, 30)) << c.logs();
  // A restarted worker takes index 1 again and joins at the current clock.
  c.add_worker(1, 1.0);
  ASSERT_EQ(c.scheduler->wait(150), 0) << c.logs();
  for (auto& w : {0, 2, 3}) EXPECT_EQ(c.workers[w]->wait(30), 0) << c.logs();
  EXPECT_EQ(c.server->wait(30), 0) << c.logs();

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

TEST(PsFault, SchedulerDeathEndsTheJobWithAClearMessage) {
  TempDir tmp("ps_sched");
  Cluster c(tmp, "run", 2, 100000);
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 5; }, 60)) << c.logs();
  c.scheduler->kill(SIGKILL);
  EXPECT_EQ(c.server->wait(20), 1) << c.logs();
  for (auto& w : c.workers) EXPECT_EQ(w->wait(20), 1) << c.logs();
  EXPECT_NE(c.server->output().find("the scheduler at"), std::string::npos) << c.logs();
  EXPECT_NE(c.workers[0]->output().find("the job ends"), std::string::npos) << c.logs();
}

}  // namespace
