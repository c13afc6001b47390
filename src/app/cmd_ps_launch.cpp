// `moetrain ps launch`: a whole parameter-server job on this machine (loopback), its processes
// forked from this binary and supervised until the job ends: the scheduler, optionally a standby
// scheduler that takes over when the scheduler dies, the servers (with backups and spares as
// asked) and the workers. Built only with ZeroMQ.
#ifdef MOETRAIN_WITH_ZMQ
#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "app/child_process.h"
#include "app/ps_launch.h"
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

// A node's command line towards `scheduler` (and the standby's address).
std::vector<std::string> node_args(const Launch& l, const std::string& role,
                                   const std::string& scheduler, const std::string& standby_ep) {
  std::vector<std::string> n = {"moetrain", "ps", role, "--scheduler", scheduler};
  if (!standby_ep.empty()) n.insert(n.end(), {"--standby-scheduler", standby_ep});
  n.insert(n.end(), l.security.begin(), l.security.end());
  return n;
}

namespace {

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

Launch prepare_launch(const LaunchArgs& a) {
  Launch l;
  l.train = parse_train_args(a.rest);
  l.cfg = load_run_config(l.train.config, l.train.overrides);
  a.opts.validate();
  ps::check_ps_run_config(l.cfg, a.opts);
  l.slow = parse_slowdowns(a);
  MOETRAIN_CHECK(a.group_size >= 1 && a.opts.workers % a.group_size == 0,
                 "--group-size {}: --workers {} (every process of every group) is not a multiple "
                 "of it",
                 a.group_size, a.opts.workers);
  MOETRAIN_CHECK(a.group_size == 1 || l.slow.empty(),
                 "--slowdown with --group-size {}: a group's ranks compute every step together, "
                 "so one rank cannot be slowed alone",
                 a.group_size);
  ps::check_worker_group(l.cfg, a.opts, a.group_size);
  // The quorum counts groups (a group's parts of a clock are applied together or not at all).
  MOETRAIN_CHECK(a.opts.consistency_kind() != ps::Consistency::Quorum ||
                     a.opts.quorum <= a.opts.workers / a.group_size,
                 "--quorum {} with --group-size {}: the quorum counts worker groups, and --workers "
                 "{} makes {}; allowed are 1..{}",
                 a.opts.quorum, a.group_size, a.opts.workers, a.opts.workers / a.group_size,
                 a.opts.workers / a.group_size);
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
  { const RunLock probe = ps::open_job_dir(l.cfg.train.run_dir, a.resume); }
  l.ps_dir = fs::path(l.cfg.train.run_dir) / "ps";
  fs::create_directories(l.ps_dir);
  l.security = {"--insecure"};
  if (!a.insecure) {
    fs::path keys = a.keys.empty() ? l.ps_dir / "keys" : fs::path(a.keys);
    if (a.keys.empty() && !fs::exists(keys / ps::kSecretKeyFile)) ps::write_job_keys(keys);
    (void)ps::read_job_keys(keys);  // a bad pair stops the launch before anything starts
    l.security = {"--keys", keys.string()};
  }
  if (a.insecure)
    log_warn("ps launch: plaintext sockets (--insecure): anyone who reaches a port can join");
  l.endpoint_file = l.ps_dir / "scheduler.endpoint";
  l.standby_file = l.ps_dir / "standby_scheduler.endpoint";
  l.pids_file = l.ps_dir / "launch.json";
  for (const auto& f : {l.endpoint_file, l.standby_file, l.pids_file}) fs::remove(f);
  return l;
}

Job start_job(const LaunchArgs& a, const Launch& l) {
  // Both schedulers get the same config, job options and keys; the standby waits until the
  // nodes find the scheduler silent and register with it.
  auto scheduler_args = [&](const fs::path& file, bool standby) {
    std::vector<std::string> s = {
        "moetrain",        "ps",         "scheduler", "--scheduler", "tcp://127.0.0.1:*",
        "--endpoint-file", file.string()};
    if (standby) s.push_back("--standby");
    if (!standby && a.resume) s.push_back("--resume");
    if (!l.train.config.empty()) s.insert(s.end(), {"--config", l.train.config});
    for (const auto& o : l.train.overrides) s.insert(s.end(), {"--set", o});
    for (const auto& o : job_option_args(a.opts)) s.push_back(o);
    s.insert(s.end(), l.security.begin(), l.security.end());
    return s;
  };
  Job job;
  job.children.push_back({"scheduler", spawn(scheduler_args(l.endpoint_file, false), 1)});
  if (a.standby)
    job.children.push_back({"standby scheduler", spawn(scheduler_args(l.standby_file, true), 1)});
  job.first_node = job.children.size();
  job.start = Clock::now();
  job.endpoint = wait_for_endpoint(job.children, 0, l.endpoint_file);
  if (a.standby) job.standby_ep = wait_for_endpoint(job.children, 1, l.standby_file);
  const std::vector<std::string> server = node_args(l, "server", job.endpoint, job.standby_ep);
  const int worker_threads = std::max(1, hardware_cores() / static_cast<int>(a.opts.workers));
  // The first S (with replicas 2S) servers to register hold the key ranges, the rest wait as
  // spares.
  const int64_t n_servers = a.opts.servers * a.opts.server_replicas + a.spare_servers;
  for (int64_t s = 0; s < n_servers; ++s)
    job.children.push_back({fmt::format("server {}", s), spawn(server, 1)});
  // Worker groups: one mpirun each, its ranks asking for the indices g·P .. g·P + P − 1.
  const int64_t P = a.group_size;
  const std::vector<std::string> worker = node_args(l, "worker", job.endpoint, job.standby_ep);
  for (int64_t g = 0; P > 1 && g < a.opts.workers / P; ++g) {
    std::vector<std::string> wa = {a.mpirun, "-n", std::to_string(P), "-x", "OMP_NUM_THREADS"};
    wa.insert(wa.end(), a.mpi_args.begin(), a.mpi_args.end());
    wa.push_back(fs::read_symlink("/proc/self/exe").string());
    wa.insert(wa.end(), worker.begin() + 1, worker.end());
    wa.insert(wa.end(), {"--index", std::to_string(g), "--ep", std::to_string(P)});
    const std::string name = fmt::format("worker group {}", g);
    job.children.push_back({name, spawn(wa, worker_threads, true)});
    job.groups[name] = {wa, worker_threads};
  }
  for (int64_t w = 0; P == 1 && w < a.opts.workers; ++w) {
    std::vector<std::string> wa = worker;
    wa.insert(wa.end(), {"--index", std::to_string(w)});
    if (l.slow.count(w)) wa.insert(wa.end(), {"--slowdown", l.slow.at(w)});
    job.children.push_back({fmt::format("worker {}", w), spawn(wa, worker_threads)});
  }
  write_pids(l.pids_file, job.children);
  log_info("ps launch: scheduler at {}{}, {} server(s){}{}, {} worker(s)", job.endpoint,
           a.standby ? fmt::format(", standby scheduler at {}", job.standby_ep) : "",
           a.opts.servers, a.opts.server_replicas == 2 ? " with backups" : "",
           a.spare_servers > 0 ? fmt::format(" and {} spare(s)", a.spare_servers) : "",
           a.opts.workers);
  return job;
}

int run_launch(const LaunchArgs& a) {
  const Launch l = prepare_launch(a);  // everything checked before anything starts
  catch_stop_signals();
  Job job = start_job(a, l);
  return supervise(a, l, job);
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
