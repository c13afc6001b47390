// The process's place in a distributed run. A program calls dist_init first thing in main; it
// starts MPI when the build has it and an MPI launcher (mpirun, srun) started the process, and
// otherwise leaves the program as one local process. Everything else asks for communicators here.
#pragma once
#include <memory>
#include <string>

#include "core/comm.h"

namespace moetrain {

// Idempotent. Sets the log rank, so that only rank 0 prints.
void dist_init(int* argc, char*** argv);
// Whether MPI is running (started by dist_init or by the program itself).
bool dist_mpi_active();
// A new communicator over every process of the run, on a channel of its own: MPI's world when
// MPI is running, else a local one-process communicator.
std::unique_ptr<Comm> dist_world(const std::string& name = "world");
// Processes of this run on this machine (1 without MPI): they share its cores.
int dist_local_size();
// Finalises MPI if it is running.
void dist_finalize();
// Ends every process of the run (MPI_Abort) or this one, with `code`. For main's error path:
// a rank that fails alone must not leave the others waiting in a collective.
[[noreturn]] void dist_abort(int code);

}  // namespace moetrain
