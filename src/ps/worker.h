// A parameter-server worker: a full model replica that computes gradients on its rows of each
// step's global batch and exchanges them with the servers through KvWorker (kv_worker.h).
#pragma once
#include <cstdint>
#include <string>

namespace moetrain::ps {

struct WorkerArgs {
  std::string scheduler;  // tcp://HOST:PORT
  double slowdown = 1.0;  // ≥ 1: each step takes this many times its compute time (a straggler)
  int64_t index = -1;     // ≥ 0: the worker index asked for (granted when free)
  std::string standby;    // the standby scheduler's tcp://HOST:PORT, if any
};

int run_worker(const WorkerArgs& args);

}  // namespace moetrain::ps
