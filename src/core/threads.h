// One thread pool for our kernels and oneDNN (both use the OpenMP runtime). When several
// processes share a machine, each gets cores / local processes threads, so nothing oversubscribes.
#pragma once

namespace moetrain {

// Sets the OpenMP thread count: `requested` if > 0, else OMP_NUM_THREADS if set, else
// hardware cores / local_processes (at least 1). Returns the count in force.
int init_threads(int requested = 0, int local_processes = 1);
int num_threads();
int hardware_cores();

}  // namespace moetrain
