// A parameter server of a training job: holds one key range of the flat parameter vector and
// the optimizer state for it. The key-value store below it (kv_server.h) does the wire and the
// consistency rules (consistency.h); this role plugs in the update rule — the run's optimizer
// (AdamW, SGD, ...) at the run's learning-rate schedule, through the one update step
// (optim/update.h) — and keeps what a training server owes the job: checkpoints, metrics, the
// summary, the roll-back to a checkpoint.
//
// Failures. A primary checkpoints its range and optimizer state every `--checkpoint-every`
// clocks (server_checkpoint.h). With `--server-replicas 2` the store streams every applied update
// (the summed gradient and the learning rate, the exact input of the optimizer step) to a backup
// that applies it the same way (kv_server.h). Without a replica, a replacement server and every
// other server roll back to the newest checkpoint they all hold (Restore from the scheduler).
#pragma once
#include <string>

namespace moetrain::ps {

struct ServerArgs {
  std::string scheduler;                   // tcp://HOST:PORT
  std::string bind = "tcp://127.0.0.1:*";  // where workers reach this server
  std::string standby;                     // the standby scheduler's tcp://HOST:PORT, if any
};

int run_server(const ServerArgs& args);

}  // namespace moetrain::ps
