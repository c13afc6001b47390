// Test support for worker groups: a parameter-server job started role by role with its workers
// as groups under mpiexec (`moetrain ps worker --ep P`), as on separate machines.
#pragma once
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "ps/process.h"  // tests/ps/process.h
#include "support/corpus.h"

namespace moetrain::testing {

inline const std::vector<std::string> kMpiexec = {
    "mpiexec", "--allow-run-as-root", "--oversubscribe", "-x", "OMP_NUM_THREADS=1", "-n"};

// A job started role by role: a scheduler, `servers` servers and `groups` worker groups of `ep`
// processes each (group g asks for indices g·ep ..), every group one mpiexec.
struct GroupJob {
  std::filesystem::path dir, run;
  std::string endpoint;
  std::unique_ptr<Process> scheduler;
  std::vector<std::unique_ptr<Process>> servers, groups;

  GroupJob(const std::filesystem::path& tmp, const std::string& name, int n_groups, int ep, int steps,
           int batch, const std::vector<std::string>& sets, int n_servers = 2,
           const std::vector<std::string>& job_args = {}, const std::string& timeout = "5",
           double slowdown = 1.0, const std::vector<double>& group_slowdowns = {})
      : dir(tmp), run(tmp / name), name_(name) {
    write_corpus(dir / "data", 60000);
    const std::string ep_file = (dir / (name + ".endpoint")).string();
    std::vector<std::string> args = {"ps", "scheduler", "--insecure", "--scheduler",
                                     "tcp://127.0.0.1:*", "--endpoint-file", ep_file,
                                     "--workers", std::to_string(n_groups * ep), "--servers",
                                     std::to_string(n_servers), "--heartbeat-interval", "0.1",
                                     "--heartbeat-timeout", timeout};
    args.insert(args.end(), job_args.begin(), job_args.end());
    std::vector<std::string> kv = tiny_ps_overrides(dir / "data", run, steps, batch);
    kv.insert(kv.end(), sets.begin(), sets.end());
    for (const auto& s : as_set_args(kv)) args.push_back(s);
    scheduler = std::make_unique<Process>(args, dir / (name + "_scheduler.log"));
    wait_for_file(ep_file, 30);
    std::ifstream(ep_file) >> endpoint;
    for (int s = 0; s < n_servers; ++s) add_server();
    ep_ = ep, slowdown_ = slowdown, group_slowdowns_ = group_slowdowns;
    for (int g = 0; g < n_groups; ++g) add_group(g);
  }
  // Starts group g (again: a replacement of a group that died), appended to `groups`.
  void add_group(int g) {
    std::vector<std::string> launcher = kMpiexec;
    launcher.push_back(std::to_string(ep_));
    groups.push_back(std::make_unique<Process>(
        std::vector<std::string>{"ps", "worker", "--insecure", "--scheduler", endpoint,
                                 "--index", std::to_string(g), "--ep", std::to_string(ep_),
                                 "--slowdown",
                                 std::to_string(g < static_cast<int>(group_slowdowns_.size())
                                                    ? group_slowdowns_[g]
                                                    : slowdown_)},
        dir / (name_ + "_group" + std::to_string(g) + "_" + std::to_string(groups.size()) +
               ".log"),
        launcher));
  }
  void add_server() {
    servers.push_back(std::make_unique<Process>(
        std::vector<std::string>{"ps", "server", "--insecure", "--scheduler", endpoint},
        dir / (name_ + "_server" + std::to_string(servers.size()) + ".log")));
  }
  std::string logs() const {
    std::string out = "scheduler:\n" + scheduler->output();
    for (const auto& s : servers) out += "server:\n" + s->output();
    for (const auto& g : groups) out += "group:\n" + g->output();
    return out;
  }
  // Waits for the job; returns the scheduler's exit code.
  int wait(double seconds) {
    const int code = scheduler->wait(seconds);
    for (auto& g : groups) g->wait(30);
    return code;
  }
  std::string name_;
  int ep_ = 1;
  double slowdown_ = 1.0;
  std::vector<double> group_slowdowns_;  // per group, where given: every rank's --slowdown
};

// `mpiexec -n procs moetrain train` (procs 0: ep) with dist.ep = ep over dir/data, the jobs' tiny
// settings and `sets`, into dir/name (its log dir/name.log): the collective run a group job is
// held to.
struct CollectiveRun {
  int code = -1;
  std::string output;
};
inline CollectiveRun collective_run(const std::filesystem::path& dir, const std::string& name,
                                    int ep, int steps, int batch,
                                    const std::vector<std::string>& sets, int procs = 0) {
  std::ofstream(dir / "defaults.toml") << "# every key from --set\n";
  std::vector<std::string> args = {"train", "--config", (dir / "defaults.toml").string()};
  std::vector<std::string> kv = tiny_ps_overrides(dir / "data", dir / name, steps, batch);
  kv.insert(kv.end(), sets.begin(), sets.end());
  kv.push_back("dist.ep=" + std::to_string(ep));
  for (const auto& s : as_set_args(kv)) args.push_back(s);
  std::vector<std::string> launcher = kMpiexec;
  launcher.push_back(std::to_string(procs > 0 ? procs : ep));
  Process mpi(args, dir / (name + ".log"), launcher);
  const int code = mpi.wait(120);
  return {code, mpi.output()};
}

// How many values of two equally long vectors differ (bitwise).
inline int64_t values_differing(const std::vector<float>& a, const std::vector<float>& b) {
  int64_t n = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) n += a[i] != b[i];
  return n;
}

}  // namespace moetrain::testing
