// `moetrain ps launch`: a whole parameter-server job on this machine (loopback), its processes
// forked from this binary and supervised until the job ends. Built only with ZeroMQ.
#ifdef MOETRAIN_WITH_ZMQ
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <thread>

#include "app/cmd_ps.h"
#include "core/check.h"
#include "core/log.h"
#include "core/threads.h"
#include "ps/options.h"
#include "ps/security.h"
#include "train/run_config.h"

namespace fs = std::filesystem;

namespace moetrain::app {

namespace {
struct Child {
  std::string name;
  pid_t pid = -1;
  bool running = true;
  int status = 0;
};

volatile sig_atomic_t g_stop_signal = 0;
void on_stop_signal(int sig) {
  g_stop_signal = sig;
}

pid_t spawn(const std::vector<std::string>& args, int omp_threads) {
  std::vector<char*> argv;
  for (const auto& s : args) argv.push_back(const_cast<char*>(s.c_str()));
  argv.push_back(nullptr);
  const std::string threads = std::to_string(omp_threads);
  pid_t pid = fork();
  MOETRAIN_CHECK(pid >= 0, "fork failed: {}", std::strerror(errno));
  if (pid == 0) {
    // A job's processes never outlive the launcher.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getenv("OMP_NUM_THREADS") == nullptr) setenv("OMP_NUM_THREADS", threads.c_str(), 1);
    execv("/proc/self/exe", argv.data());
    std::fprintf(stderr, "moetrain ps launch: cannot exec /proc/self/exe: %s\n",
                 std::strerror(errno));
    _exit(127);
  }
  return pid;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {}", WTERMSIG(status));
  return "ended";
}

void kill_all(std::vector<Child>& children) {
  for (auto& c : children)
    if (c.running) kill(c.pid, SIGTERM);
  for (int i = 0; i < 50; ++i) {
    bool any = false;
    for (auto& c : children)
      if (c.running) {
        if (waitpid(c.pid, &c.status, WNOHANG) == c.pid)
          c.running = false;
        else
          any = true;
      }
    if (!any) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (auto& c : children)
    if (c.running) {
      kill(c.pid, SIGKILL);
      waitpid(c.pid, &c.status, 0);
      c.running = false;
    }
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

struct TrainArgs {
  std::string config;
  std::vector<std::string> overrides;
};

// "train --config FILE [--set k=v]..." after `--`.
TrainArgs parse_train_args(const std::vector<std::string>& rest) {
  MOETRAIN_CHECK(!rest.empty() && rest[0] == "train",
                 "ps launch: expected `-- train --config FILE [--set key=value ...]` after the "
                 "launch options, got '{}'",
                 rest.empty() ? std::string() : rest[0]);
  TrainArgs t;
  for (std::size_t i = 1; i < rest.size(); ++i) {
    const std::string& a = rest[i];
    MOETRAIN_CHECK(i + 1 < rest.size(), "ps launch: '{}' needs a value", a);
    if (a == "--config" || a == "-c") {
      t.config = rest[++i];
    } else if (a == "--set") {
      t.overrides.push_back(rest[++i]);
    } else {
      MOETRAIN_FAIL("ps launch: unknown train argument '{}' (allowed: --config FILE, --set k=v)",
                    a);
    }
  }
  return t;
}


}  // namespace

Run add_ps_launch_command(CLI::App* ps_cmd) {
  struct Args {
    ps::PsOptions opts;
    std::string keys;
    bool insecure = false;
    std::vector<std::string> slowdowns, rest;
    double timeout = 0;
  };
  auto args = std::make_shared<Args>();
  auto* launch = ps_cmd->add_subcommand(
      "launch",
      "Start a whole job on this machine: ps launch --servers S --workers W -- train "
      "--config FILE [--set k=v]");
  add_job_options(launch, args->opts);
  launch->add_option("--keys", args->keys,
                     "Job key pair directory (default: RUN_DIR/ps/keys, made when missing)");
  launch->add_flag("--insecure", args->insecure,
                   "Plaintext sockets: anyone who reaches a port can join the job");
  launch
      ->add_option("--slowdown", args->slowdowns,
                   "WORKER=FACTOR: slow that worker down (repeatable), e.g. --slowdown 1=2")
      ->allow_extra_args(false);
  launch->add_option("--timeout", args->timeout, "Stop the job after this many seconds (0: none)");
  launch->add_option("rest", args->rest, "-- train --config FILE [--set key=value ...]");

  return [args, launch]() -> int {
    if (!launch->parsed()) return 2;
    // Validate everything before starting anything.
    TrainArgs t = parse_train_args(args->rest);
    RunConfig cfg = load_run_config(t.config, t.overrides);
    ps::check_ps_run_config(cfg);
    args->opts.validate();
    std::map<int64_t, std::string> slow;
    for (const std::string& s : args->slowdowns) {
      auto eq = s.find('=');
      int64_t w = -1;
      double f = 0;
      try {
        if (eq != std::string::npos)
          w = std::stoll(s.substr(0, eq)), f = std::stod(s.substr(eq + 1));
      } catch (const std::exception&) {
        w = -1;
      }
      MOETRAIN_CHECK(w >= 0 && w < args->opts.workers && f >= 1,
                     "--slowdown '{}': expected WORKER=FACTOR with WORKER in 0..{} and FACTOR ≥ 1",
                     s, args->opts.workers - 1);
      slow[w] = s.substr(eq + 1);
    }
    MOETRAIN_CHECK(args->keys.empty() || !args->insecure,
                   "ps launch: --keys and --insecure exclude each other");
    fs::path ps_dir = fs::path(cfg.train.run_dir) / "ps";
    fs::create_directories(ps_dir);
    std::vector<std::string> security = {"--insecure"};
    if (!args->insecure) {
      fs::path keys = args->keys.empty() ? ps_dir / "keys" : fs::path(args->keys);
      if (args->keys.empty() && !fs::exists(keys / ps::kSecretKeyFile)) ps::write_job_keys(keys);
      (void)ps::read_job_keys(keys);  // a bad pair stops the launch before anything starts
      security = {"--keys", keys.string()};
    }
    if (args->insecure)
      log_warn("ps launch: plaintext sockets (--insecure): anyone who reaches a port can join");
    const fs::path endpoint_file = ps_dir / "scheduler.endpoint";
    fs::remove(endpoint_file);

    signal(SIGINT, on_stop_signal);
    signal(SIGTERM, on_stop_signal);
    std::vector<Child> children;
    std::vector<std::string> sargs = {"moetrain",
                                      "ps",
                                      "scheduler",
                                      "--scheduler",
                                      "tcp://127.0.0.1:*",
                                      "--endpoint-file",
                                      endpoint_file.string()};
    if (!t.config.empty()) sargs.insert(sargs.end(), {"--config", t.config});
    for (const auto& o : t.overrides) sargs.insert(sargs.end(), {"--set", o});
    for (const auto& o : job_option_args(args->opts)) sargs.push_back(o);
    sargs.insert(sargs.end(), security.begin(), security.end());
    children.push_back({"scheduler", spawn(sargs, 1)});

    const auto start = std::chrono::steady_clock::now();
    auto elapsed = [&] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    std::string endpoint;
    while (endpoint.empty()) {
      int status;
      if (waitpid(children[0].pid, &status, WNOHANG) == children[0].pid) {
        children[0].running = false;
        MOETRAIN_FAIL("ps launch: the scheduler {} before it was ready", describe_status(status));
      }
      if (std::ifstream in(endpoint_file); in) std::getline(in, endpoint);
      if (endpoint.empty()) {
        if (elapsed() > 30) {
          kill_all(children);
          MOETRAIN_FAIL("ps launch: the scheduler did not bind within 30 s");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    std::vector<std::string> server_args = {"moetrain", "ps", "server", "--scheduler", endpoint};
    server_args.insert(server_args.end(), security.begin(), security.end());
    const int cores = hardware_cores();
    const int worker_threads = std::max(1, cores / static_cast<int>(args->opts.workers));
    // With replicas, the first S servers to register become primaries, the next S backups.
    for (int64_t s = 0; s < args->opts.servers * args->opts.server_replicas; ++s)
      children.push_back({fmt::format("server {}", s), spawn(server_args, 1)});
    for (int64_t w = 0; w < args->opts.workers; ++w) {
      std::vector<std::string> wa = {"moetrain", "ps",      "worker",         "--scheduler",
                                     endpoint,   "--index", std::to_string(w)};
      if (slow.count(w)) wa.insert(wa.end(), {"--slowdown", slow[w]});
      wa.insert(wa.end(), security.begin(), security.end());
      children.push_back({fmt::format("worker {}", w), spawn(wa, worker_threads)});
    }
    log_info("ps launch: scheduler at {}, {} server(s), {} worker(s)", endpoint, args->opts.servers,
             args->opts.workers);

    // The scheduler decides whether the job survives a lost node: launch fails with it, and
    // restarts a dead server (which then restores from its checkpoint) when that is the way
    // the job recovers, i.e. without replicas.
    const bool restart_servers = args->opts.server_replicas == 1 && args->opts.checkpoint_every > 0;
    std::map<std::string, int> restarts;
    bool failed = false;
    std::string why;
    for (;;) {
      bool any = false;
      std::vector<Child> respawned;
      for (auto& c : children) {
        if (!c.running) continue;
        if (waitpid(c.pid, &c.status, WNOHANG) == c.pid) {
          c.running = false;
          const bool ok = WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
          if (c.name == "scheduler") {
            if (!ok) why = fmt::format("the scheduler {}", describe_status(c.status));
            continue;
          }
          if (ok) continue;
          log_error("ps launch: {} (pid {}) {}", c.name, c.pid, describe_status(c.status));
          if (c.name.starts_with("server") && restart_servers && restarts[c.name] < 3) {
            ++restarts[c.name];
            log_warn(
                "ps launch: restarting {} (restart {} of at most 3); it restores from its "
                "checkpoint",
                c.name, restarts[c.name]);
            respawned.push_back({c.name, spawn(server_args, 1)});
          }
        } else {
          any = true;
        }
      }
      for (auto& r : respawned) children.push_back(r);
      any = any || !respawned.empty();
      if (!children[0].running) {
        // The scheduler is done: give the others a moment to finish their own way.
        for (int i = 0; i < 100; ++i) {
          bool left = false;
          for (auto& c : children)
            if (c.running && waitpid(c.pid, &c.status, WNOHANG) == c.pid)
              c.running = false;
            else
              left = left || c.running;
          if (!left) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        if (why.empty()) {
          kill_all(children);
          break;
        }
      }
      if (!any) break;
      if (!why.empty()) break;
      if (g_stop_signal) {
        why = fmt::format("stopped by signal {}", static_cast<int>(g_stop_signal));
        break;
      }
      if (args->timeout > 0 && elapsed() > args->timeout) {
        why = fmt::format("the job ran past --timeout {} s", args->timeout);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!why.empty()) {
      failed = true;
      kill_all(children);
      log_error("ps launch: {}; every process of the job was stopped", why);
    }
    print_summary(cfg.train.run_dir);
    if (failed) {
      fmt::print(stderr, "ps launch: the job failed\n");
      return 1;
    }
    fmt::print("ps launch: the job completed in {:.1f} s; checkpoint in {}/checkpoints\n",
               elapsed(), cfg.train.run_dir);
    return 0;
  };
}

}  // namespace moetrain::app

#endif  // MOETRAIN_WITH_ZMQ
