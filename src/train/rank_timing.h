// Per-rank step times for metrics.jsonl: each process's own figures gathered to every process
// (rank 0 writes them), so that a straggler shows as the largest entry instead of being hidden in
// rank 0's time, which every synchronous collective stretches to the slowest rank's.
#pragma once
#include <nlohmann/json.hpp>

#include "core/comm.h"
#include "core/profile.h"
#include "core/resident.h"

namespace moetrain {

struct RankTiming {
  double step_s = 0;      // this process's wall time of the step
  double compute_s = -1;  // < 0: the trainer does not split compute from communication
  ResidentMemory memory;  // this process's resident bytes (core/resident.h); < 0: unknown
};

// Collective over comm (called after the step's timer stopped, so the wait for the slowest rank
// lands in no rank's figure). Sets line["rank_step_time_s"] (and "rank_compute_s" when measured)
// to one entry per rank, in rank order; and the resident memory: rss_bytes and peak_rss_bytes
// (this process's VmRSS and VmHWM), peak_rss_bytes_max (the largest VmHWM of any rank) and, with
// more than one process, rank_peak_rss_bytes (each rank's). A one-process comm gathers nothing.
void add_rank_timing(Comm& comm, const RankTiming& mine, nlohmann::json& line);

// Collective over comm: each process's phase table of the step (exclusive seconds) gathered to
// every process. Sets line["profile_<phase>_s"] to one entry per rank for every phase (the
// phase's name in lower-case words joined by '_': profile_all_to_all_s), and
// line["profile_other_s"] to each rank's step_s less the sum of its phases (time in no phase).
void add_rank_phases(Comm& comm, const PhaseTable& mine, double step_s, nlohmann::json& line);

}  // namespace moetrain
