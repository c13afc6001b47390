// This machine's collectives as the trainer makes them, measured under MPI: Open MPI over shared
// memory, on a communication thread that polls politely (parallel/comm_thread.h). What a
// collective costs here is set less by the memory's copy rate than by the transport's fragments
// and how often a waiting rank polls; only the collectives themselves show it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/comm.h"

namespace moetrain::plan {

struct CommFigures {
  int64_t procs = 0;              // processes on the machine when measured
  double latency = 0;             // seconds of a one-value all-reduce
  double alltoall_bandwidth = 0;  // bytes a rank sends per second in an all-to-all, past latency
  // Ring-equivalent bytes per second of an all-reduce (reduce-scatter + all-gather), past
  // latency: an all-reduce of `b` bytes over p ranks takes 2(p − 1)·latency + 2(p − 1)/p·b / it.
  double allreduce_bandwidth = 0;
  // Seconds an all-to-all takes beyond its on-time figure when the peers arrive late (a waiting
  // rank polls with sleeps): what each of a step's exchanges costs when the ranks' compute before
  // it differs, as it does with a real router.
  double late_penalty = 0;
  // How far an all-to-all is bound by the most loaded rank's bytes (1: each rank has its own
  // link, so the rank that receives the most sets the time) rather than by the bytes all ranks
  // move together (0: one link that every rank's traffic shares). Measured from an all-to-all
  // in which rank 0 receives twice its share; 1 where not measured.
  double receiver_bound = 1;
  // Gradient bytes per second through the reduction over a group of one process (the expert
  // gradients' group under EP without DP): the same packing, reduce-scatter, all-gather and
  // unpacking, which over one process only copy; every rank at once. 0 where not measured.
  double self_reduce_bandwidth = 0;
  // Measured only where the processes outnumber the cores (one thread each): the speed a
  // process's compute gets, as a fraction of its speed computing alone, while the processes
  // alternate compute with the config's all-to-all as the trainer's step does (`share`), at
  // several ratios of compute to communication (`share_ratio`: seconds of compute, timed alone,
  // per second of one on-time exchange; ascending). Over a fast transport the processes leave
  // each exchange together and compute together, cores / processes of a core each; over a slow
  // shared link they leave it one by one as the link serves them, and compute in each other's
  // waits. Empty where not measured (each process has a core).
  std::vector<double> share_ratio, share;
};

// Every rank of `world` calls it; a rank sends `a2a_bytes` in each all-to-all (spread over the
// others) and reduces `grad_bytes` of f32 gradients. Returns the slowest rank's figures.
CommFigures measure_comm(Comm& world, int64_t grad_bytes, int64_t a2a_bytes);

// From a plain process: runs `mpirun -n procs [--oversubscribe] MPIRUN_ARGS THIS_PROGRAM plan
// --calibrate-comm ...` and reads what its rank 0 wrote. Throws, saying why, when the build has
// no MPI or mpirun fails (mpirun's reason first when it refused to start the job).
CommFigures calibrate_comm(int64_t procs, int64_t grad_bytes, int64_t a2a_bytes,
                           const std::vector<std::string>& mpirun_args = {});

// What `plan --calibrate-comm --out FILE` writes and calibrate_comm reads.
void write_comm_figures(const CommFigures& f, const std::string& path);
CommFigures read_comm_figures(const std::string& path);

}  // namespace moetrain::plan
