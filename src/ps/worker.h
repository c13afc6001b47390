// A parameter-server worker: a full model replica that computes gradients on its rows of each
// step's global batch and exchanges them with the servers through KvWorker (kv_worker.h); or one
// rank of a worker group (`mpirun -n P moetrain ps worker --ep P`), whose P processes shard the
// experts and run the expert all-to-all among themselves, each rank a worker of its own towards
// the scheduler and the servers, pushing and pulling only its share of the keys.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/comm.h"
#include "moe/moe_layer.h"
#include "train/run_config.h"

namespace moetrain::ps {

// This process's place in a worker group, made by the caller from the run's configuration (which
// only the scheduler's setup brings): ps/ meets the group's processes through these alone.
struct WorkerGroup {
  Comm* comm = nullptr;  // the group's P processes: dense gradients and values, the clock
  MoeContext moe;        // what the model's MoE layers run with: the exchange over the group
  int64_t expert_first = 0, expert_count = 0;  // the experts this rank holds
  std::shared_ptr<void> owner;                 // keeps comm and moe alive
};

struct WorkerArgs {
  std::string scheduler;  // tcp://HOST:PORT
  double slowdown = 1.0;  // ≥ 1: each step takes this many times its compute time (a straggler)
  int64_t index = -1;     // ≥ 0: the worker index asked for (granted when free); in a group of P,
                          // rank r asks for index·P + r
  std::string standby;    // the standby scheduler's tcp://HOST:PORT, if any
  int64_t ep = 1;         // --ep: processes of this worker's group (the MPI world)
  int64_t group_rank = 0, world = 1;  // this process's rank and the MPI world's size
  int local_processes = 1;            // processes of the group on this machine (they share cores)
  std::function<WorkerGroup(const RunConfig&)> make_group;  // ep > 1
};

int run_worker(const WorkerArgs& args);

}  // namespace moetrain::ps
