// The MPI backend's entry points, declared without mpi.h. Defined in comm_mpi.cpp, which is
// compiled only when the build has MPI (MOETRAIN_WITH_MPI); parallel/runtime.cpp is the only
// caller.
#pragma once
#include <memory>
#include <string>

#include "core/comm.h"

namespace moetrain::mpi {

// Whether an MPI launcher (mpirun/mpiexec, Slurm srun with PMI/PMIx) started this process.
bool launched();
// MPI_Init_thread asking for MPI_THREAD_SERIALIZED (any one thread at a time may call MPI);
// errors on MPI_COMM_WORLD return codes instead of aborting, so they become Errors.
void initialize(int* argc, char*** argv);
bool initialized();
// A duplicate of MPI_COMM_WORLD: a channel of its own.
std::unique_ptr<Comm> world(const std::string& name);
// Processes on this machine (MPI_Comm_split_type shared memory) and this process's index there.
int local_size();
int local_rank();
void finalize();
[[noreturn]] void abort(int code);

}  // namespace moetrain::mpi
