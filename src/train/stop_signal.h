// A requested stop: the first SIGINT or SIGTERM asks the run to finish its step, write a
// checkpoint and exit 128 + the signal; the handler resets itself, so a second signal takes the
// default action (exit at once).
#pragma once
#include <cstdint>
#include <string>

#include "core/comm.h"

namespace moetrain {

// Installs the handlers for the life of the object and restores the previous ones after it. The
// installing thread and the OpenMP pool block the signals meanwhile; a thread of their own takes
// them (stop_signal.cpp says why).
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
};

// The signal that asked this process to stop (SIGINT or SIGTERM), 0 when none has.
int stop_signal();

// For tests: forget a received signal.
void clear_stop_signal();

// What a step's reduction carries: {SIGINT seen, SIGTERM seen} on this process, summed over the
// processes so that every rank stops at the same step.
struct StopVotes {
  int64_t interrupt = 0, terminate = 0;
  static StopVotes local();
  // Collective over comm: every process's local votes, summed.
  static StopVotes agreed(Comm& comm);
  bool any() const { return interrupt > 0 || terminate > 0; }
  // 143 when any process got SIGTERM, else 130.
  int exit_code() const;
  int signal() const;
};

// "stopped by SIGTERM at step 12: checkpoint DIR; continue with --resume".
std::string stop_message(const StopVotes& votes, int64_t step, const std::string& checkpoint);

}  // namespace moetrain
