// Test support for tests/ps: real `moetrain` processes, each reaped however the test ends (the
// destructor kills what still runs; PR_SET_PDEATHSIG kills it if the test process dies), with
// its output in a file, and a tiny run configuration for jobs.
#pragma once
#include <cmath>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "io/metrics.h"
#include "support/corpus.h"

namespace moetrain::testing {

class Process {
 public:
  Process(std::vector<std::string> args, const std::filesystem::path& log)
      : Process(std::move(args), log, {}) {}
  // The binary under a launcher whose words go first (e.g. mpiexec -n 2), found on PATH.
  Process(std::vector<std::string> args, const std::filesystem::path& log,
          std::vector<std::string> launcher)
      : log_(log) {
    args.insert(args.begin(), MOETRAIN_BINARY);
    args.insert(args.begin(), launcher.begin(), launcher.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      FILE* f = std::fopen(log.c_str(), "w");
      if (f) {
        dup2(fileno(f), 1);
        dup2(fileno(f), 2);
      }
      setenv("OMP_NUM_THREADS", "1", 1);
      execvp(argv[0], argv.data());
      _exit(127);
    }
  }
  ~Process() { kill(SIGKILL); }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  bool running() {
    poll();
    return running_;
  }
  void kill(int sig) {
    if (!running()) return;
    ::kill(pid_, sig);
    if (sig == SIGKILL) {
      waitpid(pid_, &status_, 0);
      running_ = false;
    }
  }
  // Waits up to `seconds`; kills the process when it is still running then. Returns the exit
  // code, 128 + signal when killed, or −1 on timeout.
  int wait(double seconds) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (running() && std::chrono::steady_clock::now() < end)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (running()) {
      kill(SIGKILL);
      return -1;
    }
    if (WIFEXITED(status_)) return WEXITSTATUS(status_);
    return 128 + WTERMSIG(status_);
  }
  std::string output() const {
    std::ifstream in(log_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

 private:
  void poll() {
    if (running_ && waitpid(pid_, &status_, WNOHANG) == pid_) running_ = false;
  }
  std::filesystem::path log_;
  pid_t pid_ = -1;
  int status_ = 0;
  bool running_ = true;
};

// The small dropless top-k MoE of the tests, as `--set` arguments (no clipping: ps mode has none;
// no aux loss: the Switch loss of a split batch is not the loss of the whole batch).
inline std::vector<std::string> tiny_ps_overrides(const std::filesystem::path& data,
                                                  const std::filesystem::path& run, int steps,
                                                  int batch) {
  std::vector<std::string> kv = {"model.dim=32",
                                 "model.n_layers=2",
                                 "model.n_heads=4",
                                 "model.n_kv_heads=2",
                                 "model.expert_hidden=32",
                                 "model.n_experts=4",
                                 "model.top_k=2",
                                 "model.router=topk_softmax",
                                 "model.capacity_factor=0",
                                 "model.aux_loss_coef=0",
                                 "model.max_seq_len=32",
                                 "train.seq_len=32",
                                 "train.eval_batches=4",
                                 "train.eval_every=0",
                                 "train.progress=off",
                                 "optim.grad_clip=0",
                                 "optim.warmup_steps=2",
                                 "data.dir=" + data.string(),
                                 "train.run_dir=" + run.string(),
                                 "train.steps=" + std::to_string(steps),
                                 "train.batch_size=" + std::to_string(batch)};
  return kv;
}

inline std::vector<std::string> as_set_args(const std::vector<std::string>& kv) {
  std::vector<std::string> out;
  for (const auto& s : kv) out.insert(out.end(), {"--set", s});
  return out;
}

inline nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

// Waits until `p` exists (or `seconds` pass); returns whether it does.
inline bool wait_for_file(const std::filesystem::path& p, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!std::filesystem::exists(p) && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return std::filesystem::exists(p);
}

// A job started role by role, as on separate machines: a scheduler (heartbeats every 0.1 s, dead
// after `heartbeat_timeout` s), `servers` server processes, `n_workers` workers asking for indices
// 0.. (each sleeping `worker_slowdown` - 1 times its compute time after every step, which paces a
// job without changing its sync result), each with its log file; every process reaped when the
// cluster goes out of scope.
struct Cluster {
  std::filesystem::path dir, run;
  std::string name, endpoint, keys;  // keys: the job key pair's directory
  std::unique_ptr<Process> scheduler;
  std::vector<std::unique_ptr<Process>> servers, workers;

  Cluster(const std::filesystem::path& tmp, const std::string& job, int n_workers, int steps,
          int n_servers = 1, std::vector<std::string> job_args = {},
          const std::string& heartbeat_timeout = "1", double worker_slowdown = 1.0,
          const std::vector<std::string>& sets = {})
      : dir(tmp), run(tmp / job), name(job) {
    write_corpus(dir / "data", 60000);
    keys = (dir / (name + "_keys")).string();
    Process({"ps", "keygen", keys}, dir / (name + "_keygen.log")).wait(30);
    std::vector<std::string> args = {"ps",
                                     "scheduler",
                                     "--keys",
                                     keys,
                                     "--scheduler",
                                     "tcp://127.0.0.1:*",
                                     "--endpoint-file",
                                     (dir / (name + ".endpoint")).string(),
                                     "--workers",
                                     std::to_string(n_workers),
                                     "--heartbeat-interval",
                                     "0.1",
                                     "--heartbeat-timeout",
                                     heartbeat_timeout};
    args.insert(args.end(), job_args.begin(), job_args.end());
    for (const auto& s : as_set_args(tiny_ps_overrides(dir / "data", run, steps, 2)))
      args.push_back(s);
    for (const auto& s : as_set_args(sets)) args.push_back(s);  // after the defaults: they win
    scheduler = std::make_unique<Process>(args, dir / (name + "_scheduler.log"));
    wait_for_file(dir / (name + ".endpoint"), 30);
    std::ifstream(dir / (name + ".endpoint")) >> endpoint;
    for (int s = 0; s < n_servers; ++s) add_server();
    for (int w = 0; w < n_workers; ++w) add_worker(w, worker_slowdown);
  }
  void add_server() {
    servers.push_back(std::make_unique<Process>(
        std::vector<std::string>{"ps", "server", "--scheduler", endpoint, "--keys", keys},
        dir / (name + "_server" + std::to_string(servers.size()) + ".log")));
  }
  void add_worker(int index, double slowdown) {
    workers.push_back(std::make_unique<Process>(
        std::vector<std::string>{"ps", "worker", "--scheduler", endpoint, "--keys", keys,
                                 "--index", std::to_string(index), "--slowdown",
                                 std::to_string(slowdown)},
        dir / (name + "_worker" + std::to_string(workers.size()) + ".log")));
  }
  // The process of a node in job.json (role "server" or "worker", its index, primary or not).
  Process* find(const std::string& role, int64_t index, bool primary = true) {
    auto job = read_json(run / "ps" / "job.json");
    for (const auto& n : job["nodes"]) {
      if (n["role"] != role || n["index"] != index || (role == "server" && n["primary"] != primary))
        continue;
      for (auto* list : {&servers, &workers})
        for (auto& p : *list)
          if (p->pid() == n["pid"].get<pid_t>()) return p.get();
    }
    return nullptr;
  }
  std::string logs() const {
    std::string out = "scheduler:\n" + scheduler->output();
    for (const auto& s : servers) out += "server:\n" + s->output();
    for (const auto& w : workers) out += "worker:\n" + w->output();
    return out;
  }
};

// ‖a − ref‖ / ‖ref‖ (L2 over every element, in double): how far a job's parameters ended from the
// reference run's.
inline double relative_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

inline int64_t applied_steps(const std::filesystem::path& run) {
  int64_t n = 0;
  for (const auto& j : read_metrics(run)) n += j.contains("loss");
  return n;
}

inline double val_loss(const std::filesystem::path& run) {
  double v = -1;
  for (const auto& j : read_metrics(run))
    if (j.contains("val_loss")) v = j["val_loss"].get<double>();
  return v;
}

inline bool wait_until(const std::function<bool()>& cond, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!cond() && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return cond();
}

}  // namespace moetrain::testing
