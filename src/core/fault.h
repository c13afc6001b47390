// Fault injection, for the fault-tolerance tests and for measuring recovery. The environment
// variable MOETRAIN_FAULT describes one fault, fired on one rank at a named point of the trainer:
//
//   MOETRAIN_FAULT=ACTION:rank=R:step=S[:where=W][:attempt=A][:code=C][:ms=M]
//
//   ACTION   kill (SIGKILL itself, as `kill -9` would), stop (SIGSTOP itself: a stalled process),
//            exit (leave at once with exit code C, default 3),
//            slow (sleep M ms at every step point from S on: a straggler that keeps running),
//            comm_delay (sleep M ms inside every job the communication thread runs, from the
//            process's start: a slow link; `step` is not used),
//            route_delay (the adaptive all-to-all route, parallel/adaptive_route.h: a link change
//            at step S. Sleep M ms before every exchange over path P from step S on, and before
//            every exchange over the other path before step S)
//   rank     the MPI world rank that fails (default 0)
//   step     the trainer step at which it fails (required, except for comm_delay)
//   where    step: after optimizer step S completed (default);
//            checkpoint_write: while the checkpoint of step S is being written
//   attempt  the `moetrain launch` attempt on which it fires (MOETRAIN_ATTEMPT, which the
//            supervisor exports; 1 without it); 0 = every attempt (default 1)
//   path     route_delay: direct or relay (default direct), the path slow from step S on
//
// e.g. MOETRAIN_FAULT=kill:rank=1:step=7:where=checkpoint_write, MOETRAIN_FAULT=comm_delay:ms=20,
// MOETRAIN_FAULT=route_delay:step=5:ms=50:path=direct.
// Without the variable a fault point costs one check of a flag.
#pragma once
#include <cstdint>
#include <string>

namespace moetrain {

enum class FaultAction { Kill, Stop, Exit, Slow, CommDelay, RouteDelay };

struct FaultSpec {
  FaultAction action = FaultAction::Kill;
  int rank = 0;
  int64_t step = -1;
  std::string where = "step";
  int64_t attempt = 1;  // 0: every attempt
  int exit_code = 3;
  int64_t slow_ms = 100;  // Slow: the sleep per step; CommDelay: per communication job
  bool slow_relay = false;  // RouteDelay: the relayed path is the one slow from `step` on
};

// Parses a MOETRAIN_FAULT value; an Error names the bad field and what is allowed.
FaultSpec parse_fault_spec(const std::string& text);

// Fires MOETRAIN_FAULT when `where`, `step`, this process's rank and the attempt match it.
void fault_point(const char* where, int64_t step);

// The communication thread calls this inside each job it runs: sleeps when MOETRAIN_FAULT is a
// comm_delay for this process.
void fault_comm_job();

// The adaptive exchange calls this before each exchange of step `step` (1-based) over the direct
// (relayed = false) or the relayed path: sleeps when MOETRAIN_FAULT is a route_delay for this
// process that makes that path slow at that step.
void fault_route_exchange(bool relayed, int64_t step);

}  // namespace moetrain
