// `moetrain ps launch` (app/cmd_ps_launch.cpp): what a launch starts from and the job it started,
// and the supervisor that watches that job until it completes, fails or is stopped
// (app/ps_launch_supervisor.cpp). Built only with ZeroMQ.
#pragma once
#ifdef MOETRAIN_WITH_ZMQ
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "app/child_process.h"
#include "ps/options.h"
#include "train/run_config.h"

namespace moetrain::app {

using Clock = std::chrono::steady_clock;

struct TrainArgs {
  std::string config;
  std::vector<std::string> overrides;
};

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

// What a launch starts from, checked before anything starts.
struct Launch {
  TrainArgs train;
  RunConfig cfg;
  std::map<int64_t, std::string> slow;
  std::filesystem::path ps_dir, endpoint_file, standby_file, pids_file;
  std::vector<std::string> security;  // --insecure, or --keys DIR
};

// The job's processes: the scheduler (and the standby) first, then the nodes.
struct Job {
  std::vector<Child> children;
  // Each worker group's mpirun command line and its threads, to start it again.
  std::map<std::string, std::pair<std::vector<std::string>, int>> groups;
  std::size_t first_node = 0;
  std::string endpoint, standby_ep;
  Clock::time_point start;  // once the schedulers started (--timeout counts from here)
};

std::vector<std::string> node_args(const Launch& l, const std::string& role,
                                   const std::string& scheduler, const std::string& standby_ep);

// SIGINT and SIGTERM to the launcher are kept for the supervisor, which hands the first to the
// scheduler in charge.
void catch_stop_signals();

// Watches the job until it completes, fails or is stopped (see the supervisor's file): 0 when it
// completed, 128 + the signal when a stop signal stopped it, 1 when it failed.
int supervise(const LaunchArgs& a, const Launch& l, Job& job);

}  // namespace moetrain::app
#endif  // MOETRAIN_WITH_ZMQ
