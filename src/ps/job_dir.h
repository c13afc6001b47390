// The run directory of a parameter-server job. The scheduler holds its lock (io/run_lock.h) for
// the life of the job, as `train` does for its run; `ps launch` checks the same before it starts
// any process, so a job never writes into a directory another run is writing, and a fresh job
// never mixes its metrics and checkpoints into an earlier run's.
#pragma once
#include <filesystem>

#include "io/run_lock.h"

namespace moetrain::ps {

// Whether RUN_DIR holds an earlier run: checkpoints of the whole model (RUN_DIR/checkpoints) or
// of a server's key range (RUN_DIR/ps/server_I).
bool holds_earlier_run(const std::filesystem::path& run_dir);

// Creates and locks RUN_DIR; refuses, before anything in it is written, a directory another
// process holds, and one holding an earlier run unless `resume`.
RunLock open_job_dir(const std::filesystem::path& run_dir, bool resume);

}  // namespace moetrain::ps
