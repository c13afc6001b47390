// Fault-tolerance test support: runs the built moetrain binary (usually `moetrain launch`) as a
// real process with its own environment and a time limit, capturing its output line by line
// with the time each line arrived; and a tiny training setup (corpus + config) in a directory.
#pragma once
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "support/corpus.h"

namespace moetrain::testing {

struct OutputLine {
  double t;  // seconds since the process started
  std::string text;
};

struct ProcessResult {
  int code = -1;  // exit code; 128 + signal when killed
  bool timed_out = false;
  // The output pipe stayed open 5 s after the process ended: something it started lives on.
  bool left_processes = false;
  std::vector<OutputLine> lines;  // stdout and stderr together

  std::string output() const {
    std::string s;
    for (const auto& l : lines) s += l.text + "\n";
    return s;
  }
  // The arrival time of the first line containing `part`, or −1.
  double time_of(const std::string& part) const {
    for (const auto& l : lines)
      if (l.text.find(part) != std::string::npos) return l.t;
    return -1;
  }
  int count(const std::string& part) const {
    int n = 0;
    for (const auto& l : lines) n += l.text.find(part) != std::string::npos;
    return n;
  }
};

// What MPI jobs started by the tests need: Open MPI refuses root without these; one thread each.
inline std::vector<std::pair<std::string, std::string>> mpi_env() {
  return {{"OMPI_ALLOW_RUN_AS_ROOT", "1"},
          {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
          {"OMP_NUM_THREADS", "1"}};
}

// Runs MOETRAIN_BINARY with `args`. Past `timeout_s` the process gets SIGTERM (the supervisor
// then ends its job), and SIGKILL 15 s later; `on_line` sees every line as it arrives, and
// `on_tick` is called with the child's pid about every 100 ms while it runs.
inline ProcessResult run_moetrain(const std::vector<std::string>& args,
                                  const std::vector<std::pair<std::string, std::string>>& env,
                                  double timeout_s,
                                  const std::function<void(const OutputLine&)>& on_line = {},
                                  const std::function<void(pid_t)>& on_tick = {}) {
  using Clock = std::chrono::steady_clock;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return {};
  std::vector<std::string> argv = {MOETRAIN_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargs;
  for (auto& a : argv) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  const auto start = Clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    ::execv(cargs[0], cargs.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  ProcessResult r;
  std::string pending;
  auto seconds = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  auto flush_lines = [&](bool all) {
    for (std::size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
      r.lines.push_back({seconds(), pending.substr(0, nl)});
      pending.erase(0, nl + 1);
      if (on_line) on_line(r.lines.back());
    }
    if (all && !pending.empty()) r.lines.push_back({seconds(), pending});
  };
  double kill_at = timeout_s, exited_at = -1;
  bool terminated = false;
  int status = 0;
  for (;;) {
    if (exited_at < 0 && ::waitpid(pid, &status, WNOHANG) == pid) exited_at = seconds();
    if (exited_at >= 0 && seconds() - exited_at > 5) {
      r.left_processes = true;
      break;
    }
    pollfd p = {fds[0], POLLIN, 0};
    const int ready = ::poll(&p, 1, 100);
    if (ready > 0) {
      char buf[4096];
      const ssize_t n = ::read(fds[0], buf, sizeof(buf));
      if (n <= 0) break;  // every writer is gone
      pending.append(buf, static_cast<std::size_t>(n));
      flush_lines(false);
    }
    if (exited_at < 0 && on_tick) on_tick(pid);
    if (exited_at < 0 && seconds() > kill_at) {
      r.timed_out = true;
      ::kill(pid, terminated ? SIGKILL : SIGTERM);
      kill_at += 15;
      terminated = true;
    }
  }
  flush_lines(true);
  ::close(fds[0]);
  if (exited_at < 0) ::waitpid(pid, &status, 0);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// A tiny MoE run in `dir`: a corpus and a config with `steps` steps, a checkpoint every
// `checkpoint_every`, run directory dir/<run>. Returns the config path.
inline std::filesystem::path write_tiny_run(const std::filesystem::path& dir, int steps,
                                            int checkpoint_every) {
  write_corpus(dir / "data", 60000);
  const auto cfg = dir / "tiny.toml";
  std::ofstream out(cfg);
  out << "[model]\nvocab_size = 256\ndim = 32\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\n"
         "expert_hidden = 24\nn_experts = 4\ntop_k = 2\nmax_seq_len = 16\n"
         "[data]\ndir = \""
      << (dir / "data").string()
      << "\"\n[train]\nbatch_size = 2\nseq_len = 16\neval_every = 0\neval_batches = 2\n"
         "progress = \"off\"\nsteps = "
      << steps << "\ncheckpoint_every = " << checkpoint_every << "\n";
  return cfg;
}

}  // namespace moetrain::testing
