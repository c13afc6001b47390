// The [dist] options that `moetrain train` and `moetrain classify` share — each sets a dist.* key
// through the configuration, which checks it with the rest — and the collective watchdog both
// run under mpirun.
#pragma once
#include <memory>
#include <vector>

#include "app/options.h"
#include "parallel/watchdog.h"
#include "train/run_config.h"

namespace moetrain::app {

// --ep, --zero, --hierarchical, --ranks-per-node, --a2a-chunks, --no-overlap, the watchdog's
// settings and the wire types.
const std::vector<ConfigFlag>& dist_config_flags();

// --run-dir, --steps, --lr, --threads: the keys a user changes most, as flags.
const std::vector<ConfigFlag>& run_config_flags();

// train's: run_config_flags(), dist_config_flags(), then --precision and --device.
const std::vector<ConfigFlag>& train_config_flags();

// Under mpirun: sets debug_collectives and starts the watchdog for the run; null on one process.
std::unique_ptr<CollectiveWatchdog> watch_collectives(const DistSettings& dist);

}  // namespace moetrain::app
