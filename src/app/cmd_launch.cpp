// `moetrain launch -n N [options] -- train ...`: the supervisor (parallel/supervisor.h).
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "app/checks.h"
#include "app/commands.h"
#include "app/dist_options.h"
#include "app/options.h"
#include "data/shard.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "parallel/runtime.h"
#include "parallel/supervisor.h"
#include "train/run_config.h"

namespace fs = std::filesystem;

namespace moetrain::app {

namespace {

// This process's own argument list: CLI11 does not say whether `--` was given.
std::vector<std::string> own_arguments() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> out;
  for (std::size_t at = 0; at < all.size();) {
    const std::size_t end = all.find('\0', at);
    out.push_back(all.substr(at, end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return out;
}

std::string self_executable() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string("moetrain");
}

int usage_error(const std::string& message) {
  std::fprintf(stderr, "moetrain launch: %s\n", message.c_str());
  return 2;
}

// "reached step 7; last complete checkpoint: step 6", from the run directory.
std::string run_progress(const fs::path& run_dir) {
  std::string reached = "no step recorded";
  int64_t step = -1;
  for (const nlohmann::json& j : read_metrics(run_dir))
    if (j.contains("step") && j["step"].is_number())
      step = std::max(step, j["step"].get<int64_t>());
  if (step >= 0) reached = fmt::format("reached step {}", step);
  std::string ckpt = "no complete checkpoint";
  try {
    if (auto latest = find_latest_checkpoint(run_dir)) {
      const auto state = read_checkpoint_json(*latest, "trainer_state.json");
      ckpt = fmt::format("last complete checkpoint: step {}", state.value("step", int64_t{-1}));
    }
  } catch (const std::exception& e) {
    ckpt = fmt::format("checkpoints unreadable: {}", e.what());
  }
  return reached + "; " + ckpt;
}

}  // namespace

Run add_launch_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "launch",
      "Run `mpirun -n N moetrain train ...` and restart it with --resume from its last complete "
      "checkpoint when it fails: moetrain launch -n 4 -- train -c configs/tiny.toml");
  struct Args {
    int procs = 0, min_procs = 0, max_restarts = 3;
    double backoff = 2, grace = 10;
    std::string hostfile, mpirun = "mpirun";
    std::vector<std::string> mpi_args, command;
  };
  auto args = std::make_shared<Args>();
  // The command is read below from the process's own arguments (CLI11 does not say whether `--`
  // was given); extras are let through so that a command without `--` is named as such.
  cmd->allow_extras();
  cmd->add_option("command", args->command, "-- then the moetrain command to run: train ...");
  cmd->add_option("-n,--np", args->procs, "Processes to run (mpirun -n)")->required();
  cmd->add_option("--max-restarts", args->max_restarts, "Restarts after a failure before giving up")
      ->check(integer_in(0, std::numeric_limits<int>::max()));
  cmd->add_option("--backoff", args->backoff,
                  "Seconds before the first restart, doubled for each further one")
      ->check(number_at_least(0));
  cmd->add_option("--hostfile", args->hostfile,
                  "Open MPI hostfile (lines 'host slots=N'), passed to mpirun and re-read before "
                  "every attempt to count the available slots")
      ->check(CLI::ExistingFile);
  cmd->add_option("--min-procs", args->min_procs,
                  "Elastic: when fewer slots than -n are available (hostfile, else this machine's "
                  "processors), run on as few as this many (default: off)")
      ->check(integer_in(1, std::numeric_limits<int>::max()));
  cmd->add_option("--mpirun", args->mpirun, "The MPI launcher (a name is looked up in PATH)");
  add_mpi_arg_option(cmd, args->mpi_args);
  cmd->add_option("--grace", args->grace,
                  "After SIGINT/SIGTERM: seconds the job has to end before it is killed")
      ->check(number_at_least(0));
  return [args] {
    if (dist_mpi_active())
      return usage_error("runs mpirun itself: start it directly, not under mpirun or srun");
    if (args->procs < 1) return usage_error(fmt::format("-n {}: must be ≥ 1", args->procs));
    if (args->min_procs > args->procs)
      return usage_error(
          fmt::format("--min-procs {} is more than -n {}", args->min_procs, args->procs));
    // The command is everything after the first `--` that follows "launch". CLI11 lets extras
    // through (so that a command without `--` is named as such), so the words before `--` are
    // checked here: launch's own options and their values only.
    const std::vector<std::string> argv = own_arguments();
    std::vector<std::string> before, command;
    bool seen_launch = false, seen_dashes = false;
    for (const auto& a : argv) {
      if (seen_dashes) {
        command.push_back(a);
      } else if (!seen_launch) {
        seen_launch = a == "launch";
      } else if (a == "--") {
        seen_dashes = true;
      } else {
        before.push_back(a);
      }
    }
    if (!seen_dashes)
      return usage_error(
          "missing `--` before the command to run, e.g. moetrain launch -n 4 -- train -c "
          "configs/tiny.toml");
    static const std::set<std::string> kValued = {"-n",          "--np",     "--max-restarts",
                                                  "--backoff",   "--grace",  "--hostfile",
                                                  "--min-procs", "--mpirun", "--mpi-arg"};
    for (std::size_t i = 0; i < before.size(); ++i) {
      const std::string& w = before[i];
      const std::string name = w.substr(0, w.find('='));
      if (kValued.count(name) && name != w) continue;  // --option=value
      if (kValued.count(w)) {
        ++i;  // its value
        continue;
      }
      if (w.size() > 2 && w.rfind("-n", 0) == 0 && w[2] != '-') continue;  // -n4
      return usage_error(fmt::format(
          "'{}' before `--` is not a launch option: launch options go before `--`, the command "
          "after it (see moetrain launch --help)",
          w));
    }
    if (command.empty())
      return usage_error(
          "nothing after `--`: give the command to run, e.g. -- train -c "
          "configs/tiny.toml");
    if (command[0] != "train")
      return usage_error(
          fmt::format("'{}' after `--` is not a command launch can supervise (expected: train ...)",
                      command[0]));

    // Check the train command here, before any process starts, and find its run directory.
    CLI::App check{"moetrain"};
    add_train_command(check);
    try {
      check.parse(std::vector<std::string>(command.rbegin(), command.rend()));
    } catch (const CLI::ParseError& e) {
      return usage_error(fmt::format("the command after `--` is not valid: {}", e.what()));
    }
    CLI::App* train = check.get_subcommand("train");
    std::vector<std::string> sets;
    if (train->get_option("--set")->count() > 0)
      sets = train->get_option("--set")->as<std::vector<std::string>>();
    // The flags that set keys too (--run-dir moves the run directory).
    sets = given_config_flags(*train, train_config_flags(), sets);
    const RunConfig cfg = load_run_config(train->get_option("--config")->as<std::string>(), sets);
    const fs::path run_dir = cfg.train.run_dir;
    // Every rank runs on this machine: its data is this machine's, and data every attempt would
    // refuse is named before the first one (on other hosts data.dir is theirs to check).
    if (args->hostfile.empty())
      (void)open_token_shards(cfg.data.dir, cfg.model.vocab_size, cfg.train.seq_len);

    SupervisorConfig sc;
    sc.procs = args->procs;
    sc.min_procs = args->min_procs;
    sc.max_restarts = args->max_restarts;
    sc.backoff_s = args->backoff;
    sc.grace_s = args->grace;
    sc.hostfile = args->hostfile;
    sc.mpirun = args->mpirun;
    sc.mpirun_args = args->mpi_args;
    sc.program = self_executable();
    sc.command = command;
    sc.progress = [run_dir] { return run_progress(run_dir); };
    // One line per attempt with its cause: the report's restarts table.
    auto launcher = std::make_shared<MetricsWriter>(
        MetricsWriter::role(run_dir, "launcher", MetricsWriter::Open::Fresh));
    sc.on_attempt = [launcher](const AttemptResult& a) {
      launcher->write({{"event", a.success ? "attempt_succeeded" : "attempt_failed"},
                       {"time", std::chrono::duration<double>(
                                    std::chrono::system_clock::now().time_since_epoch())
                                    .count()},
                       {"attempt", a.attempt},
                       {"procs", a.procs},
                       {"seconds", a.seconds},
                       {"cause", a.reason},
                       {"watchdog", a.reason.find("watchdog") != std::string::npos},
                       {"progress", a.progress}});
    };
    SupervisorResult r = supervise(sc);
    std::fputs(r.summary.c_str(), stderr);
    return r.exit_code;
  };
}

}  // namespace moetrain::app
