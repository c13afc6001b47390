// One thread pool for our kernels and oneDNN (both use the OpenMP runtime). When several
// processes share a machine, each gets cores / local processes threads, so nothing oversubscribes.
#pragma once

namespace moetrain {

// Sets the OpenMP thread count: `requested` if > 0, else OMP_NUM_THREADS if set, else
// hardware cores / local_processes (at least 1). Returns the count in force.
int init_threads(int requested = 0, int local_processes = 1);
int num_threads();
int hardware_cores();

// Pins each OpenMP thread to a CPU of its own, in the order of this process's affinity mask, when
// the pool fills the mask exactly and the user has asked for no placement (OMP_PROC_BIND,
// OMP_PLACES and GOMP_CPU_AFFINITY unset). Unpinned, the kernel moves the pool's threads between
// cores; on a 2-core machine one-process training steps measured slower that way (docs/PERF.md,
// "Threads pinned to cores"; the planner's kernel calibration, which times its kernels in tight
// loops, measured the same either way and stays unpinned). Only for a process that runs alone:
// threads and processes it starts while pinned inherit the calling thread's one CPU, so call
// unpin_threads() before starting any. Says so in the log and returns whether it pinned.
bool pin_threads();
// Gives every OpenMP thread the process's whole mask back (a no-op when nothing was pinned).
void unpin_threads();

}  // namespace moetrain
