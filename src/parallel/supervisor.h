// The supervisor behind `moetrain launch`: runs a job under mpirun and restarts it when it fails.
//
// Open MPI 4.1 cannot repair a communicator after a failure, so recovery is: let the job end
// (mpirun takes every rank down when one dies, exits non-zero, or the collective watchdog aborts
// it), then start it again with --resume from the last complete checkpoint, after a back-off,
// until it succeeds or the restart budget is spent. Each attempt re-counts the available slots
// (the hostfile is re-read); with min_procs, an attempt may run on fewer processes than asked.
//
// mpirun runs in its own process group with stdin from /dev/null, and dies with the supervisor
// (PR_SET_PDEATHSIG). The supervisor is a child subreaper: ranks orphaned by a dying mpirun become
// its children, and after every attempt it kills whatever is left of the job, so it never leaves
// orphans. SIGINT/SIGTERM/SIGHUP are forwarded to mpirun; after a grace period the job is killed.
// It never initialises MPI itself.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace moetrain {

struct AttemptResult;

struct SupervisorConfig {
  int procs = 1;      // processes asked for (mpirun -n)
  int min_procs = 0;  // > 0: run on as few as this many when fewer slots are available
  int max_restarts = 3;
  double backoff_s = 2;  // before restart k: backoff_s · 2^(k−1) seconds
  std::string hostfile;  // "" = this machine only
  std::string mpirun = "mpirun";
  std::vector<std::string> mpirun_args;  // passed to mpirun verbatim, before the program
  std::string program;                   // the executable each rank runs
  std::vector<std::string> command;      // its arguments ("train", "-c", ...)
  std::string resume_flag = "--resume";  // added to `command` from the second attempt on
  double grace_s = 10;                   // after a forwarded signal, before killing the job
  // "reached step 7; last complete checkpoint: step 6", asked after each attempt (optional).
  std::function<std::string()> progress;
  // Told each attempt's outcome as it ends (launcher.jsonl; optional).
  std::function<void(const AttemptResult&)> on_attempt;
};

struct AttemptResult {
  int attempt = 0;  // 1, 2, ...
  int procs = 0;    // 0: not launched (too few slots)
  bool success = false;
  int exit_code = -1;  // the job's exit code; -1 when it died of a signal or never ran
  std::string reason;  // "completed", "a process died of signal 9 (Killed)", ...
  double seconds = 0;
  std::string progress;
  std::string error;  // the job's first error message (job_error), when it failed
};

struct SupervisorResult {
  int exit_code = 0;  // 0 success; 1 failed or budget spent; 128 + signal when interrupted
  std::vector<AttemptResult> attempts;
  std::string summary;  // several lines, printed by the caller
};

// Slots of an Open MPI hostfile: the sum over its host lines of slots=N (1 when absent);
// '#' starts a comment. An Error names the file and line of anything else.
int hostfile_slots(const std::string& path);
// Slots without a hostfile: this machine's online processors.
int machine_slots();

// The reason an mpirun wait status stands for ("completed", "exit code 3", ...).
std::string describe_job_status(int wait_status);

// Why mpirun would not start a job, from what it printed ("mpirun refuses to run as root: ..."),
// when it is a refusal that a retry would meet again (running as root, an unknown option, a
// program it cannot execute); "" otherwise. The supervisor stops at once on such a refusal.
std::string mpirun_refusal(const std::string& output);

// The first error the job's processes printed ("moetrain: error: MESSAGE" → MESSAGE), "" when
// none did. A failed attempt whose error and progress equal the attempt's before it ends the
// supervision: the job meets the error wherever it starts.
std::string job_error(const std::string& output);

// Runs the attempts; prints one line per event on stderr ("moetrain launch [+3.2 s]: ...").
SupervisorResult supervise(const SupervisorConfig& config);

}  // namespace moetrain
