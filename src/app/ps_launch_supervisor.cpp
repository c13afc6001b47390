// The supervisor of `moetrain ps launch` (app/ps_launch.h): reaps the job's processes, restarts
// what the job recovers by (a dead server without replicas, a failed worker group), hands a stop
// signal to the scheduler in charge and enforces the time limits. Built only with ZeroMQ.
#ifdef MOETRAIN_WITH_ZMQ
#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "app/child_process.h"
#include "app/job_progress.h"
#include "app/ps_launch.h"
#include "core/log.h"
#include "io/file.h"

namespace fs = std::filesystem;

namespace moetrain::app {

namespace {

volatile sig_atomic_t g_stop_signal = 0;
void on_stop_signal(int sig) {
  g_stop_signal = sig;
}

void print_summary(const fs::path& run_dir) {
  fs::path dir = run_dir / "ps";
  if (!fs::is_directory(dir)) return;
  int64_t push = 0, dense = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!name.ends_with(".json")) continue;
    std::ifstream in(e.path());
    auto j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded()) continue;
    if (name.starts_with("server_")) {
      fmt::print(
          "server {}: {} updates, {} pushes, {} late pushes dropped, largest staleness {}, "
          "{} bad messages rejected\n",
          j.value("index", 0), j.value("updates", 0), j.value("pushes", 0),
          j.value("late_dropped", 0), j.value("max_staleness", 0), j.value("rejected_messages", 0));
    } else if (name.starts_with("worker_")) {
      push += j.value("push_bytes", int64_t{0});
      dense += j.value("dense_push_bytes", int64_t{0});
    }
  }
  if (dense > 0)
    fmt::print("pushes: {} bytes on the wire, {} as dense f32 ({:.1f}% saved)\n", push, dense,
               100.0 * (1.0 - static_cast<double>(push) / static_cast<double>(dense)));
}

// Watches the job until it completes, fails or is stopped. The scheduler in charge decides whether
// the job survives a lost node: launch succeeds or fails with it. When the scheduler dies and a
// standby runs, the standby is in charge (the nodes move to it by themselves); without a standby
// the servers elect one of themselves (ps/election.h). Without replicas launch restarts a dead
// server (which then restores from its checkpoint), as that is the way the job recovers.
class Supervisor {
 public:
  Supervisor(const LaunchArgs& a, const Launch& l, Job& job)
      : a_(a), l_(l), job_(job),
        server_args_(node_args(l, "server", job.endpoint, job.standby_ep)),
        restart_servers_(a.opts.server_replicas == 1 && a.opts.checkpoint_every > 0) {}

  // 0 when the job completed, 128 + the signal when a stop signal stopped it, 1 when it failed.
  int run() {
    JobProgress progress(l_.cfg);
    while (!completed_ && !stopped_ && why_.empty()) {
      progress.poll();
      std::vector<Child> respawned;
      std::vector<Child>& children = job_.children;
      for (std::size_t i = 0; i < children.size(); ++i) {
        Child& c = children[i];
        if (!c.running || waitpid(c.pid, &c.status, WNOHANG) != c.pid) continue;
        c.running = false;
        ended(i, respawned);
      }
      if (!respawned.empty()) {
        children.insert(children.end(), respawned.begin(), respawned.end());
        write_pids(l_.pids_file, children);
      }
      if (completed_ || stopped_ || !why_.empty()) break;
      watch();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // The scheduler in charge is done: the nodes get a moment to finish their own way (an idle
    // standby is stopped with whatever is left). Stopped: the scheduler told every node, and
    // they end by themselves.
    if (completed_) wait_until_ended(job_.children, job_.first_node, 5.0);
    if (stopped_) wait_until_ended(job_.children, 0, 5.0);
    kill_all(job_.children);
    progress.finish();
    if (!why_.empty()) log_error("ps launch: {}; every process of the job was stopped", why_);
    print_summary(l_.cfg.train.run_dir);
    if (stopped_) {
      fmt::print(stderr,
                 "ps launch: stopped by signal {}; every server checkpointed its keys; continue "
                 "with the same command and --resume\n",
                 forwarded_);
      return 128 + forwarded_;
    }
    if (!why_.empty()) {
      fmt::print(stderr, "ps launch: the job failed\n");
      return 1;
    }
    fmt::print("ps launch: the job completed in {:.1f} s; checkpoint in {}/checkpoints\n",
               elapsed(), l_.cfg.train.run_dir);
    return 0;
  }

 private:
  double elapsed() const {
    return std::chrono::duration<double>(Clock::now() - job_.start).count();
  }

  // Child i ended (its status in children[i]).
  void ended(std::size_t i, std::vector<Child>& respawned) {
    const std::vector<Child>& children = job_.children;
    const Child& c = children[i];
    const std::size_t first_node = job_.first_node;
    const bool ok = exited_ok(c.status);
    if (i < first_node && i != in_charge_) {
      log_warn("ps launch: the standby scheduler (pid {}) {}; the job goes on without one", c.pid,
               describe_status(c.status));
    } else if (i < first_node && ok) {
      completed_ = true;
    } else if (i == in_charge_ && forwarded_ != 0 && WIFEXITED(c.status) &&
               WEXITSTATUS(c.status) == 128 + forwarded_) {
      stopped_ = true;
    } else if (i < first_node && i == 0 && a_.standby && children[1].running) {
      in_charge_ = 1;
      log_warn(
          "ps launch: the scheduler (pid {}) {}; the standby scheduler (pid {}) at {} takes "
          "over once the nodes find it silent",
          c.pid, describe_status(c.status), children[1].pid, job_.standby_ep);
      // A server restarted from now on registers with the standby.
      server_args_ = node_args(l_, "server", job_.standby_ep, "");
    } else if (i == 0 && !a_.standby) {
      elected_ = true;
      log_warn("ps launch: the scheduler (pid {}) {}; the servers elect one of themselves to "
               "take its role once they find it silent",
               c.pid, describe_status(c.status));
    } else if (i < first_node) {
      why_ = fmt::format("the {} {}", c.name, describe_status(c.status));
    } else if (elected_ && ok) {
      completed_ = true;
    } else if (!ok) {
      log_error("ps launch: {} (pid {}) {}", c.name, c.pid, describe_status(c.status));
      if (c.name.starts_with("server") && restart_servers_ && restarts_[c.name] < 3) {
        ++restarts_[c.name];
        log_warn(
            "ps launch: restarting {} (restart {} of at most 3); it restores from its "
            "checkpoint",
            c.name, restarts_[c.name]);
        if (elected_) {
          // It registers with the elected scheduler, whose address is in job.json.
          std::ifstream in(l_.ps_dir / "job.json");
          const auto j = nlohmann::json::parse(in, nullptr, false);
          if (j.is_object() && j.value("scheduler", "") != job_.endpoint)
            server_args_ = node_args(l_, "server", j.value("scheduler", ""), "");
        }
        respawned.push_back({c.name, spawn(server_args_, 1)});
      } else if (job_.groups.count(c.name) && restarts_[c.name] < 3) {
        // A rank that died took its group down (MPI ends the job of a failed rank). The group's
        // new ranks ask for the same indices and join at the servers' clock; meanwhile sync goes
        // on with the other workers.
        ++restarts_[c.name];
        log_warn("ps launch: restarting {} (restart {} of at most 3); its ranks pull the "
                 "servers' state and join at the current clock",
                 c.name, restarts_[c.name]);
        auto [args, threads] = job_.groups.at(c.name);
        if (elected_ || in_charge_ != 0) {
          // Towards the scheduler in charge: the standby, or the elected one (job.json).
          std::ifstream in(l_.ps_dir / "job.json");
          const auto j = nlohmann::json::parse(in, nullptr, false);
          const std::string now = in_charge_ != 0 ? job_.standby_ep
                                  : j.is_object() ? j.value("scheduler", "")
                                                  : "";
          auto at = std::find(args.begin(), args.end(), "--scheduler");
          if (!now.empty() && at != args.end() && at + 1 != args.end()) *(at + 1) = now;
        }
        respawned.push_back({c.name, spawn(args, threads, true)});
      }
    }
  }

  // Between reaps: a job nobody is left to end, stop signals, the time limits.
  void watch() {
    std::vector<Child>& children = job_.children;
    // The scheduler died and every node ended too (e.g. it had stopped the job before it died):
    // nobody is left to register with the standby.
    bool nodes_left = false;  // (not reaped here: ended() handles each child that ends)
    for (std::size_t i = job_.first_node; i < children.size(); ++i)
      nodes_left |= children[i].running;
    if ((in_charge_ != 0 || elected_) && !nodes_left) {
      if (!nodes_gone_) nodes_gone_ = Clock::now();
      if (std::chrono::duration<double>(Clock::now() - *nodes_gone_).count() > 10)
        why_ = elected_ ? "the scheduler died and every server and worker ended without an "
                          "elected scheduler ending the job"
                        : "the scheduler died and every server and worker ended without the "
                          "standby scheduler ending the job";
    }
    // A stop signal is handed to the scheduler in charge, which stops the job with a checkpoint
    // (ps/scheduler.h) and exits 128 + the signal; a second signal stops every process at once.
    if (g_stop_signal != 0 && forwarded_ == 0 && children[in_charge_].running) {
      forwarded_ = static_cast<int>(g_stop_signal);
      g_stop_signal = 0;
      forwarded_at_ = Clock::now();
      signal(forwarded_, SIG_DFL);  // a second one ends the launcher (and with it every process)
      kill(children[in_charge_].pid, forwarded_);
      log_warn("ps launch: signal {}: the scheduler stops the job with a checkpoint", forwarded_);
    } else if (g_stop_signal != 0) {
      why_ = fmt::format("stopped by signal {}", static_cast<int>(g_stop_signal));
    }
    if (forwarded_at_ &&
        std::chrono::duration<double>(Clock::now() - *forwarded_at_).count() > 120)
      why_ = fmt::format("stopped by signal {}; the scheduler did not stop the job within 120 s",
                         forwarded_);
    if (a_.timeout > 0 && elapsed() > a_.timeout)
      why_ = fmt::format("the job ran past --timeout {} s", a_.timeout);
  }

  const LaunchArgs& a_;
  const Launch& l_;
  Job& job_;
  std::vector<std::string> server_args_;  // how a restarted server starts
  const bool restart_servers_;
  std::size_t in_charge_ = 0;  // the scheduler in charge: 0, or 1 (the standby)
  bool elected_ = false;       // the scheduler died without a standby
  std::map<std::string, int> restarts_;
  bool completed_ = false, stopped_ = false;
  std::string why_;  // why the job failed
  std::optional<Clock::time_point> nodes_gone_;
  int forwarded_ = 0;  // the stop signal handed to the scheduler in charge
  std::optional<Clock::time_point> forwarded_at_;
};

}  // namespace

void catch_stop_signals() {
  signal(SIGINT, on_stop_signal);
  signal(SIGTERM, on_stop_signal);
}

int supervise(const LaunchArgs& a, const Launch& l, Job& job) {
  return Supervisor(a, l, job).run();
}

}  // namespace moetrain::app
#endif  // MOETRAIN_WITH_ZMQ
