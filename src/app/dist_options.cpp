#include "app/dist_options.h"

#include <fmt/format.h>

#include "parallel/runtime.h"

namespace moetrain::app {

void add_dist_options(CLI::App* cmd, DistOptions& o) {
  cmd->add_option(
         "--ep", o.ep,
         "Expert-parallel group size under mpirun (same as --set dist.ep=E): world = DP x EP")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--zero", o.zero, "1: ZeRO-1 optimizer-state sharding under mpirun (dist.zero)")
      ->check(CLI::Range(0, 1));
}

void append_dist_overrides(const DistOptions& o, std::vector<std::string>& overrides) {
  if (o.ep > 0) overrides.push_back(fmt::format("dist.ep={}", o.ep));
  if (o.zero >= 0) overrides.push_back(fmt::format("dist.zero={}", o.zero));
}

std::unique_ptr<CollectiveWatchdog> watch_collectives(const DistSettings& dist) {
  // Collectives exist only under mpirun; the watchdog watches them for the whole run.
  if (!dist_mpi_active()) return nullptr;
  set_debug_collectives(dist.debug_collectives);
  return std::make_unique<CollectiveWatchdog>(
      WatchdogSettings{dist.collective_warn, dist.collective_timeout});
}

}  // namespace moetrain::app
