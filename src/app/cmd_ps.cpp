// `moetrain ps scheduler|server|worker|keygen`: the parameter-server mode, each role its own
// process; `ps launch`, a whole job on this machine, is in cmd_ps_launch.cpp. Built only with
// ZeroMQ (MOETRAIN_WITH_ZMQ).
#ifdef MOETRAIN_WITH_ZMQ
#include <fmt/format.h>

#include <memory>
#include <type_traits>

#include "app/cmd_ps.h"
#include "core/check.h"
#include "core/log.h"
#include "core/threads.h"
#include "ps/options.h"
#include "ps/scheduler.h"
#include "ps/security.h"
#include "ps/server.h"
#include "ps/worker.h"
#include "parallel/runtime.h"
#include "train/parallel_setup.h"
#include "train/run_config.h"

namespace moetrain::app {

namespace {

// Every job option once, as f(name, member, help): what the scheduler and launch accept, and
// what launch hands on to the scheduler it starts.
template <class Options, class F>
void for_each_job_option(Options& o, F&& f) {
  f("--servers", o.servers, "Parameter servers (key ranges)");
  f("--workers", o.workers, "Workers to wait for before the first clock");
  f("--consistency", o.consistency, "sync | quorum | async | ssp | half_sync | average");
  f("--quorum", o.quorum, "quorum: pushes that apply a clock");
  f("--staleness", o.staleness, "ssp, half_sync: clocks the fastest worker may lead");
  f("--half-sync-wait-ms", o.half_sync_wait_ms,
    "half_sync: bound of each worker's random wait per clock (ms; seeded by train.seed)");
  f("--local-steps", o.local_steps,
    "average: optimizer steps each worker takes between two parameter averages");
  f("--push-compression", o.push_compression, "none | bf16 | int8");
  f("--pull-compression", o.pull_compression,
    "none | bf16 | int8: parameters sent to workers (servers keep f32)");
  // A switch that clears the member when given.
  f("!--dense-push", o.sparse_push,
    "Push every expert's gradient, also of experts that received no tokens");
  f("--assign", o.assign, "uniform | capability (rows by measured throughput)");
  f("--rebalance-every", o.rebalance_every,
    "capability: seconds at least between two re-splits of the rows (default 2)");
  f("--heartbeat-interval", o.heartbeat_interval, "Seconds between heartbeats");
  f("--heartbeat-timeout", o.heartbeat_timeout,
    "Seconds of silence after which a node is declared dead");
  f("--server-replicas", o.server_replicas,
    "2: each server streams every applied update to a backup that takes over");
  f("--checkpoint-every", o.checkpoint_every,
    "Clocks between server checkpoints of shard and optimizer state (0: none between; the "
    "job's end and a stop by signal still write one)");
  f("--server-wait", o.server_wait,
    "Seconds to wait for a dead server's replacement before the job stops");
}

}  // namespace

void add_job_options(CLI::App* cmd, ps::PsOptions& o) {
  for_each_job_option(o, [cmd](const char* name, auto& member, const char* help) {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(member)>, bool>)
      cmd->add_flag(name, member, help);
    else
      cmd->add_option(name, member, help);
  });
}

std::vector<std::string> job_option_args(const ps::PsOptions& o) {
  std::vector<std::string> a;
  for_each_job_option(o, [&a](const char* name, const auto& member, const char*) {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(member)>, bool>) {
      if (!member) a.emplace_back(name + 1);  // the switch, without CLI11's "!"
    } else {
      a.insert(a.end(), {name, fmt::format("{}", member)});
    }
  });
  return a;
}

namespace {

// Every role's sockets are CURVE with the job key pair in --keys DIR, or plaintext with an
// explicit --insecure; nothing in between.
void add_security_options(CLI::App* cmd, std::string& keys, bool& insecure) {
  cmd->add_option("--keys", keys, "Directory with the job key pair (moetrain ps keygen DIR)");
  cmd->add_flag("--insecure", insecure,
                "Plaintext sockets: anyone who reaches a port can join the job");
}

void choose_security(const std::string& role, const std::string& keys, bool insecure) {
  MOETRAIN_CHECK(keys.empty() || !insecure, "ps {}: --keys and --insecure exclude each other",
                 role);
  MOETRAIN_CHECK(!keys.empty() || insecure,
                 "ps {}: give --keys DIR (a job key pair from `moetrain ps keygen DIR`) or "
                 "--insecure for plaintext sockets",
                 role);
  if (insecure) {
    ps::use_plaintext();
    log_warn("ps {}: plaintext sockets (--insecure): anyone who reaches its port can join", role);
  } else {
    ps::use_curve(ps::read_job_keys(keys));
  }
}

// A worker group (`mpirun -n P moetrain ps worker --ep P`): the experts sharded over the MPI
// world and the expert exchange over it, made as `train` makes them under mpirun with dist.ep = P.
ps::WorkerGroup make_worker_group(const std::shared_ptr<Comm>& world, const RunConfig& cfg) {
  struct Holder {
    std::shared_ptr<Comm> world;
    RunParallel rp;
  };
  auto h = std::make_shared<Holder>();
  h->world = world;
  DistSettings dist = cfg.dist;
  dist.ep = world->size();
  h->rp = make_run_parallel(*world, dist, cfg.model.n_experts, cfg.model.n_moe_layers() > 0);
  ps::WorkerGroup g;
  g.comm = h->rp.groups->control.get();
  g.moe = h->rp.moe_context();
  g.expert_first = h->rp.experts.first;
  g.expert_count = h->rp.experts.count;
  g.owner = h;
  return g;
}

}  // namespace

Run add_ps_command(CLI::App& app) {
  auto* ps_cmd = app.add_subcommand(
      "ps", "Parameter-server mode over ZeroMQ: scheduler, servers and workers as processes");
  ps_cmd->require_subcommand(1);

  struct Args {
    ps::PsOptions opts;
    std::string scheduler, standby, endpoint_file, bind = "tcp://127.0.0.1:*", config, keys,
                                                   keygen_dir;
    bool insecure = false, standby_flag = false, resume = false;
    std::vector<std::string> overrides;
    double slowdown = 1.0;
    int64_t index = -1, ep = 1;
  };
  auto args = std::make_shared<Args>();

  auto* sched =
      ps_cmd->add_subcommand("scheduler", "The gatekeeper: membership, key ranges, clocks");
  sched
      ->add_option("--scheduler", args->scheduler,
                   "Address to bind, tcp://HOST:PORT (PORT * picks a free one)")
      ->required();
  sched->add_option("--endpoint-file", args->endpoint_file, "Write the bound address here");
  sched->add_option("-c,--config", args->config,
                    "Training config (TOML), as for `moetrain train` (none: defaults and --set)");
  sched->add_option("--set", args->overrides, "Override a config key (repeatable)");
  sched->add_flag("--standby", args->standby_flag,
                  "Stand by for the job's scheduler: take over when its nodes (started with "
                  "--standby-scheduler at this address) find it gone");
  sched->add_flag("--resume", args->resume,
                  "Continue the job in train.run_dir from the newest clock every server "
                  "checkpointed (without it a directory holding a run is refused)");
  add_job_options(sched, args->opts);
  add_security_options(sched, args->keys, args->insecure);

  auto* server = ps_cmd->add_subcommand("server", "A parameter server (one key range)");
  server->add_option("--scheduler", args->scheduler, "tcp://HOST:PORT of the scheduler")
      ->required();
  server->add_option("--bind", args->bind,
                     "Where workers reach this server (default: loopback, "
                     "free port)");
  server->add_option("--standby-scheduler", args->standby,
                     "tcp://HOST:PORT of the standby scheduler that takes over when the "
                     "scheduler stops answering");
  add_security_options(server, args->keys, args->insecure);

  auto* worker = ps_cmd->add_subcommand("worker", "A worker (a full model replica)");
  worker->add_option("--scheduler", args->scheduler, "tcp://HOST:PORT of the scheduler")
      ->required();
  worker->add_option("--slowdown", args->slowdown,
                     "Emulate a straggler: each step takes this many times its compute time");
  worker->add_option("--index", args->index,
                     "Ask for this worker index (data rows, sum order); granted when free. In a "
                     "group of P, rank r asks for index·P + r");
  worker->add_option("--ep", args->ep,
                     "Processes of this worker's group, started together with `mpirun -n P`: "
                     "the experts are sharded over them and each pushes and pulls its share");
  worker->add_option("--standby-scheduler", args->standby,
                     "tcp://HOST:PORT of the standby scheduler that takes over when the "
                     "scheduler stops answering");
  add_security_options(worker, args->keys, args->insecure);

  const Run launch_run = add_ps_launch_command(ps_cmd);

  auto* keygen = ps_cmd->add_subcommand(
      "keygen",
      "Write a job key pair (CURVE, Z85 text, mode 0600): DIR/job.public, DIR/job.secret");
  keygen->add_option("dir", args->keygen_dir, "Directory for the key pair")->required();

  return [args, sched, server, worker, launch_run, keygen]() -> int {
    if (keygen->parsed()) {
      ps::write_job_keys(args->keygen_dir);
      fmt::print("ps keygen: job key pair written to {}\n", args->keygen_dir);
      return 0;
    }
    if (sched->parsed() || server->parsed() || worker->parsed())
      choose_security(sched->parsed()    ? "scheduler"
                      : server->parsed() ? "server"
                                         : "worker",
                      args->keys, args->insecure);
    if (sched->parsed()) {
      ps::SchedulerArgs a;
      a.config = load_run_config(args->config, args->overrides);
      a.options = args->opts;
      a.bind = args->scheduler;
      a.endpoint_file = args->endpoint_file;
      a.standby = args->standby_flag;
      a.resume = args->resume;
      return ps::run_scheduler(a);
    }
    if (server->parsed()) {
      init_threads(1);
      return ps::run_server({args->scheduler, args->bind, args->standby});
    }
    if (worker->parsed()) {
      ps::WorkerArgs a;
      a.scheduler = args->scheduler;
      a.slowdown = args->slowdown;
      a.index = args->index;
      a.standby = args->standby;
      a.ep = args->ep;
      std::shared_ptr<Comm> world = dist_world("ps worker group");
      a.group_rank = world->rank();
      a.world = world->size();
      a.local_processes = dist_local_size();
      a.make_group = [world](const RunConfig& cfg) { return make_worker_group(world, cfg); };
      return ps::run_worker(a);
    }
    return launch_run();
  };
}

}  // namespace moetrain::app

#endif  // MOETRAIN_WITH_ZMQ
