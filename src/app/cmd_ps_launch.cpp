// `moetrain ps launch`: a whole parameter-server job on this machine (loopback), its processes
// forked from this binary and supervised until the job ends: the scheduler, optionally a standby
// scheduler that takes over when the scheduler dies, the servers (with backups and spares as
// asked) and the workers. Built only with ZeroMQ.
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
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "app/cmd_ps.h"
#include "app/job_progress.h"
#include "app/options.h"
#include "core/check.h"
#include "core/log.h"
#include "core/threads.h"
#include "io/file.h"
#include "ps/job_dir.h"
#include "ps/options.h"
#include "ps/security.h"
#include "train/run_config.h"

namespace fs = std::filesystem;

namespace moetrain::app {

namespace {

using Clock = std::chrono::steady_clock;

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

// args[0] "moetrain" is this binary; a worker group's args[0] is mpirun, found on PATH.
pid_t spawn(const std::vector<std::string>& args, int omp_threads, bool on_path = false) {
  std::vector<char*> argv;
  for (const auto& s : args) argv.push_back(const_cast<char*>(s.c_str()));
  argv.push_back(nullptr);
  const std::string threads = std::to_string(omp_threads);
  pid_t pid = fork();
  MOETRAIN_CHECK(pid >= 0, "fork failed: {}", std::strerror(errno));
  if (pid == 0) {
    // A job's processes never outlive the launcher, and a terminal's Ctrl-C reaches the launcher
    // alone (their own process group): the launcher asks the scheduler to stop the job.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    setpgid(0, 0);
    if (getenv("OMP_NUM_THREADS") == nullptr) setenv("OMP_NUM_THREADS", threads.c_str(), 1);
    if (on_path) execvp(argv[0], argv.data());
    else execv("/proc/self/exe", argv.data());
    std::fprintf(stderr, "moetrain ps launch: cannot exec %s: %s\n",
                 on_path ? argv[0] : "/proc/self/exe", std::strerror(errno));
    _exit(127);
  }
  return pid;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {}", WTERMSIG(status));
  return "ended";
}

bool exited_ok(int status) {
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
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

// RUN_DIR/ps/launch.json: every process of the job by name and pid (what to watch or kill).
void write_pids(const fs::path& file, const std::vector<Child>& children) {
  nlohmann::json procs = nlohmann::json::array();
  for (const auto& c : children)
    procs.push_back({{"name", c.name}, {"pid", c.pid}, {"running", c.running}});
  const nlohmann::json j = {{"launcher", static_cast<int64_t>(::getpid())}, {"processes", procs}};
  write_file_atomic(file, j.dump(2) + "\n");
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

struct LaunchArgs {
  ps::PsOptions opts;
  std::string keys;
  bool insecure = false, standby = false, resume = false;
  int64_t spare_servers = 0;
  int64_t group_size = 1;  // > 1: the workers are groups of this many processes under mpirun
  std::vector<std::string> slowdowns, rest, mpi_args;
  std::string mpirun = "mpirun";
  double timeout = 0;
};

// WORKER=FACTOR of --slowdown, by worker.
std::map<int64_t, std::string> parse_slowdowns(const LaunchArgs& a) {
  std::map<int64_t, std::string> slow;
  for (const std::string& s : a.slowdowns) {
    auto eq = s.find('=');
    int64_t w = -1;
    double f = 0;
    try {
      if (eq != std::string::npos) w = std::stoll(s.substr(0, eq)), f = std::stod(s.substr(eq + 1));
    } catch (const std::exception&) {
      w = -1;
    }
    MOETRAIN_CHECK(w >= 0 && w < a.opts.workers && f >= 1,
                   "--slowdown '{}': expected WORKER=FACTOR with WORKER in 0..{} and FACTOR ≥ 1", s,
                   a.opts.workers - 1);
    slow[w] = s.substr(eq + 1);
  }
  return slow;
}

// Waits until the scheduler children[i] wrote its bound address to `file`.
std::string wait_for_endpoint(std::vector<Child>& children, std::size_t i, const fs::path& file) {
  const auto start = Clock::now();
  for (;;) {
    int status;
    if (waitpid(children[i].pid, &status, WNOHANG) == children[i].pid) {
      children[i].running = false;
      kill_all(children);
      MOETRAIN_FAIL("ps launch: the {} {} before it was ready", children[i].name,
                    describe_status(status));
    }
    std::string endpoint;
    if (std::ifstream in(file); in) std::getline(in, endpoint);
    if (!endpoint.empty()) return endpoint;
    if (std::chrono::duration<double>(Clock::now() - start).count() > 30) {
      kill_all(children);
      MOETRAIN_FAIL("ps launch: the {} did not bind within 30 s", children[i].name);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int run_launch(const LaunchArgs& a) {
  // Validate everything before starting anything.
  TrainArgs t = parse_train_args(a.rest);
  RunConfig cfg = load_run_config(t.config, t.overrides);
  a.opts.validate();
  ps::check_ps_run_config(cfg, a.opts);
  const std::map<int64_t, std::string> slow = parse_slowdowns(a);
  MOETRAIN_CHECK(a.group_size >= 1 && a.opts.workers % a.group_size == 0,
                 "--group-size {}: --workers {} (every process of every group) is not a multiple "
                 "of it",
                 a.group_size, a.opts.workers);
  MOETRAIN_CHECK(a.group_size == 1 || slow.empty(),
                 "--slowdown with --group-size {}: a group's ranks compute every step together, "
                 "so one rank cannot be slowed alone",
                 a.group_size);
  ps::check_worker_group(cfg, a.opts, a.group_size);
  MOETRAIN_CHECK(a.spare_servers >= 0 && a.spare_servers <= 64,
                 "--spare-servers {}: must be in 0..64", a.spare_servers);
  MOETRAIN_CHECK(a.spare_servers == 0 || a.opts.server_replicas == 2 || a.opts.checkpoint_every > 0,
                 "--spare-servers {}: a spare becomes a lost server's new backup "
                 "(--server-replicas 2) or takes its place from its checkpoint "
                 "(--checkpoint-every N > 0); with neither it would never be used",
                 a.spare_servers);
  MOETRAIN_CHECK(a.keys.empty() || !a.insecure,
                 "ps launch: --keys and --insecure exclude each other");
  // What the scheduler will check when it takes the run directory's lock, checked before this
  // writes anything there (the keys, the endpoint files): another run writing it, or an earlier
  // run without --resume.
  { const RunLock probe = ps::open_job_dir(cfg.train.run_dir, a.resume); }
  const fs::path ps_dir = fs::path(cfg.train.run_dir) / "ps";
  fs::create_directories(ps_dir);
  std::vector<std::string> security = {"--insecure"};
  if (!a.insecure) {
    fs::path keys = a.keys.empty() ? ps_dir / "keys" : fs::path(a.keys);
    if (a.keys.empty() && !fs::exists(keys / ps::kSecretKeyFile)) ps::write_job_keys(keys);
    (void)ps::read_job_keys(keys);  // a bad pair stops the launch before anything starts
    security = {"--keys", keys.string()};
  }
  if (a.insecure)
    log_warn("ps launch: plaintext sockets (--insecure): anyone who reaches a port can join");
  const fs::path endpoint_file = ps_dir / "scheduler.endpoint",
                 standby_file = ps_dir / "standby_scheduler.endpoint",
                 pids_file = ps_dir / "launch.json";
  for (const auto& f : {endpoint_file, standby_file, pids_file}) fs::remove(f);

  signal(SIGINT, on_stop_signal);
  signal(SIGTERM, on_stop_signal);
  // Both schedulers get the same config, job options and keys; the standby waits until the
  // nodes find the scheduler silent and register with it.
  auto scheduler_args = [&](const fs::path& file, bool standby) {
    std::vector<std::string> s = {
        "moetrain",        "ps",         "scheduler", "--scheduler", "tcp://127.0.0.1:*",
        "--endpoint-file", file.string()};
    if (standby) s.push_back("--standby");
    if (!standby && a.resume) s.push_back("--resume");
    if (!t.config.empty()) s.insert(s.end(), {"--config", t.config});
    for (const auto& o : t.overrides) s.insert(s.end(), {"--set", o});
    for (const auto& o : job_option_args(a.opts)) s.push_back(o);
    s.insert(s.end(), security.begin(), security.end());
    return s;
  };
  std::vector<Child> children;
  children.push_back({"scheduler", spawn(scheduler_args(endpoint_file, false), 1)});
  if (a.standby)
    children.push_back({"standby scheduler", spawn(scheduler_args(standby_file, true), 1)});
  const std::size_t first_node = children.size();
  const auto start = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  const std::string endpoint = wait_for_endpoint(children, 0, endpoint_file);
  const std::string standby_ep = a.standby ? wait_for_endpoint(children, 1, standby_file) : "";
  auto node_args = [&](const std::string& role, const std::string& scheduler, bool with_standby) {
    std::vector<std::string> n = {"moetrain", "ps", role, "--scheduler", scheduler};
    if (with_standby) n.insert(n.end(), {"--standby-scheduler", standby_ep});
    n.insert(n.end(), security.begin(), security.end());
    return n;
  };
  std::vector<std::string> server_args = node_args("server", endpoint, a.standby);
  const int cores = hardware_cores();
  const int worker_threads = std::max(1, cores / static_cast<int>(a.opts.workers));
  // The first S (with replicas 2S) servers to register hold the key ranges, the rest wait as
  // spares.
  const int64_t n_servers = a.opts.servers * a.opts.server_replicas + a.spare_servers;
  for (int64_t s = 0; s < n_servers; ++s)
    children.push_back({fmt::format("server {}", s), spawn(server_args, 1)});
  // Worker groups: one mpirun each, its ranks asking for the indices g·P .. g·P + P − 1.
  const int64_t P = a.group_size;
  for (int64_t g = 0; P > 1 && g < a.opts.workers / P; ++g) {
    std::vector<std::string> wa = {a.mpirun, "-n", std::to_string(P), "-x", "OMP_NUM_THREADS"};
    wa.insert(wa.end(), a.mpi_args.begin(), a.mpi_args.end());
    wa.push_back(fs::read_symlink("/proc/self/exe").string());
    const std::vector<std::string> n = node_args("worker", endpoint, a.standby);
    wa.insert(wa.end(), n.begin() + 1, n.end());
    wa.insert(wa.end(), {"--index", std::to_string(g), "--ep", std::to_string(P)});
    children.push_back({fmt::format("worker group {}", g), spawn(wa, worker_threads, true)});
  }
  for (int64_t w = 0; P == 1 && w < a.opts.workers; ++w) {
    std::vector<std::string> wa = node_args("worker", endpoint, a.standby);
    wa.insert(wa.end(), {"--index", std::to_string(w)});
    if (slow.count(w)) wa.insert(wa.end(), {"--slowdown", slow.at(w)});
    children.push_back({fmt::format("worker {}", w), spawn(wa, worker_threads)});
  }
  write_pids(pids_file, children);
  log_info("ps launch: scheduler at {}{}, {} server(s){}{}, {} worker(s)", endpoint,
           a.standby ? fmt::format(", standby scheduler at {}", standby_ep) : "", a.opts.servers,
           a.opts.server_replicas == 2 ? " with backups" : "",
           a.spare_servers > 0 ? fmt::format(" and {} spare(s)", a.spare_servers) : "",
           a.opts.workers);

  // The scheduler in charge decides whether the job survives a lost node: launch succeeds or
  // fails with it. When the scheduler dies and a standby runs, the standby is in charge (the
  // nodes move to it by themselves). Without replicas launch restarts a dead server (which then
  // restores from its checkpoint), as that is the way the job recovers.
  const bool restart_servers = a.opts.server_replicas == 1 && a.opts.checkpoint_every > 0;
  std::size_t in_charge = 0;
  // The scheduler died without a standby: the servers elect one of themselves to run it
  // (ps/election.h), and a node that ends with 0 was told the job completed.
  bool elected = false;
  std::map<std::string, int> restarts;
  bool completed = false;
  std::string why;
  std::optional<Clock::time_point> nodes_gone;
  // A stop signal is handed to the scheduler in charge, which stops the job with a checkpoint
  // (ps/scheduler.h) and exits 128 + the signal; a second signal stops every process at once.
  int forwarded = 0;
  std::optional<Clock::time_point> forwarded_at;
  bool stopped = false;
  JobProgress progress(cfg);
  while (!completed && !stopped && why.empty()) {
    progress.poll();
    std::vector<Child> respawned;
    for (std::size_t i = 0; i < children.size(); ++i) {
      Child& c = children[i];
      if (!c.running || waitpid(c.pid, &c.status, WNOHANG) != c.pid) continue;
      c.running = false;
      const bool ok = exited_ok(c.status);
      if (i < first_node && i != in_charge) {
        log_warn("ps launch: the standby scheduler (pid {}) {}; the job goes on without one", c.pid,
                 describe_status(c.status));
      } else if (i < first_node && ok) {
        completed = true;
      } else if (i == in_charge && forwarded != 0 && WIFEXITED(c.status) &&
                 WEXITSTATUS(c.status) == 128 + forwarded) {
        stopped = true;
      } else if (i < first_node && i == 0 && a.standby && children[1].running) {
        in_charge = 1;
        log_warn(
            "ps launch: the scheduler (pid {}) {}; the standby scheduler (pid {}) at {} takes "
            "over once the nodes find it silent",
            c.pid, describe_status(c.status), children[1].pid, standby_ep);
        // A server restarted from now on registers with the standby.
        server_args = node_args("server", standby_ep, false);
      } else if (i == 0 && !a.standby) {
        elected = true;
        log_warn("ps launch: the scheduler (pid {}) {}; the servers elect one of themselves to "
                 "take its role once they find it silent",
                 c.pid, describe_status(c.status));
      } else if (i < first_node) {
        why = fmt::format("the {} {}", c.name, describe_status(c.status));
      } else if (elected && ok) {
        completed = true;
      } else if (!ok) {
        log_error("ps launch: {} (pid {}) {}", c.name, c.pid, describe_status(c.status));
        if (c.name.starts_with("server") && restart_servers && restarts[c.name] < 3) {
          ++restarts[c.name];
          log_warn(
              "ps launch: restarting {} (restart {} of at most 3); it restores from its "
              "checkpoint",
              c.name, restarts[c.name]);
          if (elected) {
            // It registers with the elected scheduler, whose address is in job.json.
            std::ifstream in(ps_dir / "job.json");
            const auto job = nlohmann::json::parse(in, nullptr, false);
            if (job.is_object() && job.value("scheduler", "") != endpoint)
              server_args = node_args("server", job.value("scheduler", ""), false);
          }
          respawned.push_back({c.name, spawn(server_args, 1)});
        }
      }
    }
    if (!respawned.empty()) {
      children.insert(children.end(), respawned.begin(), respawned.end());
      write_pids(pids_file, children);
    }
    if (completed || stopped || !why.empty()) break;
    // The scheduler died and every node ended too (e.g. it had stopped the job before it died):
    // nobody is left to register with the standby.
    bool nodes_left = false;
    for (std::size_t i = first_node; i < children.size(); ++i) nodes_left |= children[i].running;
    if ((in_charge != 0 || elected) && !nodes_left) {
      if (!nodes_gone) nodes_gone = Clock::now();
      if (std::chrono::duration<double>(Clock::now() - *nodes_gone).count() > 10)
        why = elected ? "the scheduler died and every server and worker ended without an "
                        "elected scheduler ending the job"
                      : "the scheduler died and every server and worker ended without the "
                        "standby scheduler ending the job";
    }
    if (g_stop_signal != 0 && forwarded == 0 && children[in_charge].running) {
      forwarded = static_cast<int>(g_stop_signal);
      g_stop_signal = 0;
      forwarded_at = Clock::now();
      signal(forwarded, SIG_DFL);  // a second one ends the launcher (and with it every process)
      kill(children[in_charge].pid, forwarded);
      log_warn("ps launch: signal {}: the scheduler stops the job with a checkpoint", forwarded);
    } else if (g_stop_signal != 0) {
      why = fmt::format("stopped by signal {}", static_cast<int>(g_stop_signal));
    }
    if (forwarded_at && std::chrono::duration<double>(Clock::now() - *forwarded_at).count() > 120)
      why = fmt::format("stopped by signal {}; the scheduler did not stop the job within 120 s",
                        forwarded);
    if (a.timeout > 0 && elapsed() > a.timeout)
      why = fmt::format("the job ran past --timeout {} s", a.timeout);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (completed) {
    // The scheduler in charge is done: give the nodes a moment to finish their own way; an idle
    // standby is stopped with whatever is left.
    for (int i = 0; i < 100; ++i) {
      bool left = false;
      for (std::size_t k = first_node; k < children.size(); ++k) {
        Child& c = children[k];
        if (c.running && waitpid(c.pid, &c.status, WNOHANG) == c.pid) c.running = false;
        left = left || c.running;
      }
      if (!left) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  if (stopped) {
    // The scheduler told the nodes; they end by themselves.
    for (int i = 0; i < 100; ++i) {
      bool left = false;
      for (std::size_t k = 0; k < children.size(); ++k) {
        Child& c = children[k];
        if (c.running && waitpid(c.pid, &c.status, WNOHANG) == c.pid) c.running = false;
        left = left || c.running;
      }
      if (!left) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  kill_all(children);
  progress.finish();
  if (!why.empty()) log_error("ps launch: {}; every process of the job was stopped", why);
  print_summary(cfg.train.run_dir);
  if (stopped) {
    fmt::print(stderr,
               "ps launch: stopped by signal {}; every server checkpointed its keys; continue "
               "with the same command and --resume\n",
               forwarded);
    return 128 + forwarded;
  }
  if (!why.empty()) {
    fmt::print(stderr, "ps launch: the job failed\n");
    return 1;
  }
  fmt::print("ps launch: the job completed in {:.1f} s; checkpoint in {}/checkpoints\n", elapsed(),
             cfg.train.run_dir);
  return 0;
}

}  // namespace

Run add_ps_launch_command(CLI::App* ps_cmd) {
  auto args = std::make_shared<LaunchArgs>();
  auto* launch = ps_cmd->add_subcommand(
      "launch",
      "Start a whole job on this machine: ps launch --servers S --workers W -- train "
      "--config FILE [--set k=v]");
  add_job_options(launch, args->opts);
  launch->add_flag("--standby-scheduler", args->standby,
                   "Also start a standby scheduler, its address given to every node: when the "
                   "scheduler dies it takes over and the job goes on");
  launch->add_option("--spare-servers", args->spare_servers,
                     "Extra servers that wait as spares: each becomes the new backup of a shard "
                     "that lost one (--server-replicas 2) or replaces a dead server from its "
                     "checkpoint");
  launch->add_option("--keys", args->keys,
                     "Job key pair directory (default: RUN_DIR/ps/keys, made when missing)");
  launch->add_flag("--insecure", args->insecure,
                   "Plaintext sockets: anyone who reaches a port can join the job");
  launch
      ->add_option("--slowdown", args->slowdowns,
                   "WORKER=FACTOR: slow that worker down (repeatable), e.g. --slowdown 1=2")
      ->allow_extra_args(false);
  launch->add_option("--group-size", args->group_size,
                     "Start the workers as groups of this many processes, each group one "
                     "`mpirun -n P moetrain ps worker --ep P` sharding the experts (--workers "
                     "counts every process)");
  launch->add_option("--mpirun", args->mpirun, "The MPI launcher of worker groups");
  add_mpi_arg_option(launch, args->mpi_args)->allow_extra_args(false);
  launch->add_option("--timeout", args->timeout, "Stop the job after this many seconds (0: none)");
  launch->add_flag("--resume", args->resume,
                   "Continue the job in train.run_dir from the newest clock every server "
                   "checkpointed (without it a directory holding a run is refused)");
  launch->add_option("rest", args->rest, "-- train --config FILE [--set key=value ...]");
  return [args, launch]() -> int { return launch->parsed() ? run_launch(*args) : 2; };
}

}  // namespace moetrain::app

#endif  // MOETRAIN_WITH_ZMQ
