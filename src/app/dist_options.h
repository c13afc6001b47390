// The [dist] options that `moetrain train` and `moetrain classify` share, turned into --set
// overrides so that the configuration checks them with the rest, and the collective watchdog both
// run under mpirun.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "parallel/watchdog.h"
#include "train/run_config.h"

namespace moetrain::app {

struct DistOptions {
  int64_t ep = 0, zero = -1;  // 0 / −1: the configuration's
};

void add_dist_options(CLI::App* cmd, DistOptions& o);
void append_dist_overrides(const DistOptions& o, std::vector<std::string>& overrides);

// Under mpirun: sets debug_collectives and starts the watchdog for the run; null on one process.
std::unique_ptr<CollectiveWatchdog> watch_collectives(const DistSettings& dist);

}  // namespace moetrain::app
