// A parameter server: holds one key range of the flat parameter vector and the optimizer state
// for it, and applies pushed gradients with the run's optimizer (the update rule plugged in from
// optim/: AdamW, SGD, ...) at the run's learning-rate schedule. When an update applies, and when
// a pull is answered, is the consistency mode's decision:
//   sync    every active worker's push for the clock, summed in worker-index order
//   quorum  the first q pushes for the clock; later ones for an old clock are dropped, counted
//   async   each push on arrival
//   ssp     each push on arrival; a pull from a worker at clock c waits until the slowest active
//           worker has reached c − s
// Bad messages are rejected with a log line and counted; the server goes on serving.
//
// Failures. A primary checkpoints its range and optimizer state every `--checkpoint-every`
// clocks (server_checkpoint.h). With `--server-replicas 2` it also streams every applied update
// (the summed gradient and the learning rate, the exact input of its optimizer step) to a backup
// that applies it the same way, and answers a pull only once the backup has confirmed every
// update the reply contains: nothing a worker has seen can be lost when the primary dies and
// the scheduler promotes the backup. Without a replica, a replacement server and every other
// server roll back to the newest checkpoint they all hold (Restore from the scheduler).
#pragma once
#include <string>

namespace moetrain::ps {

struct ServerArgs {
  std::string scheduler;                   // tcp://HOST:PORT
  std::string bind = "tcp://127.0.0.1:*";  // where workers reach this server
};

int run_server(const ServerArgs& args);

}  // namespace moetrain::ps
