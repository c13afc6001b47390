// The scheduler ("gatekeeper") of a parameter-server job. It holds only metadata: who is alive,
// which key range each server holds, which rows of each step's global batch each worker reads.
// It starts the job once the expected servers and workers have registered, re-plans when a
// worker dies or joins (a dead worker's rows go to the others, a newcomer starts at the current
// clock), and closes the job when every worker is done: the lead worker writes the final
// checkpoint, then the servers their summaries. When a server dies it promotes its backup
// (--server-replicas 2); without one it waits for a replacement (a restarted server, or a spare
// that registered earlier) and rolls every server back to the newest checkpoint they all hold,
// then tells the workers, which drop what they were doing and pull (generation + 1).
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "ps/options.h"
#include "train/run_config.h"

namespace moetrain::ps {

struct SchedulerArgs {
  RunConfig config;
  PsOptions options;
  std::string bind = "tcp://127.0.0.1:*";  // ROUTER endpoint; * picks a free port
  std::string endpoint_file;               // when set, the bound endpoint is written there
  // A standby: it waits for the nodes of a running job to register again when its scheduler
  // dies (they know its address from --standby-scheduler), then runs the job on.
  bool standby = false;
  // Continue the job RUN_DIR holds: once the servers registered, every one restores the newest
  // checkpointed clock they all hold and the workers go on from there. Without it, a directory
  // holding an earlier run is refused (ps/job_dir.h).
  bool resume = false;
  // A server elected by the surviving servers to take the role of a scheduler that died without
  // a standby (ps/election.h): what the election decided and why ("cause", "server", "node",
  // "passed_over"), written as the `scheduler_elected` event. It runs as a standby does.
  nlohmann::json elected;
};

// Runs the job to its end; returns 0 when every worker finished and the final checkpoint was
// written, non-zero (with the reason logged) when the job had to stop. The first SIGINT or
// SIGTERM stops the job like `train`: the workers finish the clock they are in, every server
// checkpoints its key range at the same clock, and the scheduler returns 128 + the signal; the
// job continues with `resume`.
int run_scheduler(const SchedulerArgs& args);

}  // namespace moetrain::ps
