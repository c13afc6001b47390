#include "app/dist_options.h"

#include "app/checks.h"

#include "parallel/runtime.h"

namespace moetrain::app {

using Kind = ConfigFlag::Kind;

const std::vector<ConfigFlag>& run_config_flags() {
  static const std::vector<ConfigFlag> flags = {
      {.name = "--run-dir",
       .kind = Kind::Text,
       .key = "train.run_dir",
       .help = "Directory of the run: checkpoints, metrics, report"},
      {.name = "--steps",
       .kind = Kind::Int,
       .key = "train.steps",
       .help = "Optimizer steps to train",
       .check = integer_in(0)},
      {.name = "--lr",
       .kind = Kind::Number,
       .key = "optim.lr",
       .help = "Peak learning rate",
       .check = number_at_least(0)},
      {.name = "--threads",
       .kind = Kind::Int,
       .key = "train.threads",
       .help = "OpenMP threads per process (0 = the cores shared among this machine's processes)",
       .check = integer_in(0)},
  };
  return flags;
}

const std::vector<ConfigFlag>& dist_config_flags() {
  static const std::vector<ConfigFlag> flags = {
      {.name = "--ep",
       .kind = Kind::Int,
       .key = "dist.ep",
       .help = "Expert-parallel group size under mpirun (same as --set dist.ep=E): world = DP x EP",
       .check = integer_in(1)},
      {.name = "--zero",
       .kind = Kind::Int,
       .key = "dist.zero",
       .help = "ZeRO stage under mpirun: 1 shards the optimizer state, 2 the reduced gradients "
               "too, 3 the parameters too (dist.zero)",
       .check = integer_in(0, 3)},
      {.name = "--hierarchical",
       .kind = Kind::Switch,
       .key = "dist.hierarchical",
       .help = "Two-stage expert all-to-all: within nodes, then between them (dist.hierarchical)",
       .value = "true"},
      {.name = "--ranks-per-node",
       .kind = Kind::Int,
       .key = "dist.ranks_per_node",
       .help = "With the two-stage all-to-all: ranks per node, overriding detection (emulates "
               "nodes); implies --hierarchical",
       .implies = "dist.hierarchical=true",
       .check = integer_in(0)},
      {.name = "--adaptive-route",
       .kind = Kind::Switch,
       .key = "dist.adaptive_route",
       .help = "Each step's cross-node all-to-all rows go direct or through the two-stage route, "
               "whichever measured cheaper (dist.adaptive_route)",
       .value = "true"},
      {.name = "--a2a-chunks",
       .kind = Kind::Int,
       .key = "dist.a2a_chunks",
       .help = "Split each MoE all-to-all into n chunks overlapped with expert compute "
               "(dist.a2a_chunks)",
       .check = integer_in(1, 64)},
      {.name = "--no-overlap",
       .kind = Kind::Switch,
       .key = "dist.overlap",
       .help = "Reduce gradients after backward instead of during it (dist.overlap = false)",
       .value = "false"},
      {.name = "--collective-warn",
       .kind = Kind::Number,
       .key = "dist.collective_warn",
       .help = "Under mpirun: warn when a collective has waited this many seconds "
               "(dist.collective_warn, default 60; 0 = off)",
       .check = number_at_least(0)},
      {.name = "--collective-timeout",
       .kind = Kind::Number,
       .key = "dist.collective_timeout",
       .help = "Under mpirun: abort the job when a collective has waited this many seconds, "
               "naming it, so that `moetrain launch` restarts it (dist.collective_timeout, "
               "default 300; 0 = off)",
       .check = number_at_least(0)},
      {.name = "--debug-collectives",
       .kind = Kind::Switch,
       .key = "dist.debug_collectives",
       .help = "Under mpirun: ranks compare every collective's fingerprint (sequence, kind, "
               "element size, counts) before running it; a mismatch fails at once "
               "(dist.debug_collectives)",
       .value = "true"},
      {.name = "--grad-reduce-dtype",
       .kind = Kind::Text,
       .key = "dist.grad_reduce_dtype",
       .help = "Data-parallel gradient reduction on the wire: f32, bf16 or int8 "
               "(dist.grad_reduce_dtype)"},
      {.name = "--sync",
       .kind = Kind::Text,
       .key = "dist.sync",
       .help = "What data-parallel replicas synchronise: grads (reduced every step) or params "
               "(local SGD: own steps, parameters averaged every --sync-every steps) (dist.sync)"},
      {.name = "--sync-every",
       .kind = Kind::Int,
       .key = "dist.sync_every",
       .help = "With --sync params: average the parameters every H steps (dist.sync_every)",
       .check = integer_in(1)},
      {.name = "--sync-moments",
       .kind = Kind::Switch,
       .key = "dist.sync_moments",
       .help = "With --sync params: average the optimizer moments too (dist.sync_moments)",
       .value = "true"},
      {.name = "--a2a-dtype",
       .kind = Kind::Text,
       .key = "dist.a2a_dtype",
       .help = "Expert all-to-all payloads on the wire: f32 or bf16 (dist.a2a_dtype)"},
  };
  return flags;
}

std::unique_ptr<CollectiveWatchdog> watch_collectives(const DistSettings& dist) {
  // Collectives exist only under mpirun; the watchdog watches them for the whole run.
  if (!dist_mpi_active()) return nullptr;
  set_debug_collectives(dist.debug_collectives);
  return std::make_unique<CollectiveWatchdog>(
      WatchdogSettings{dist.collective_warn, dist.collective_timeout});
}

}  // namespace moetrain::app
