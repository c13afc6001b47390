// A communicator whose every call runs on a communication thread (parallel/comm_thread.h), the
// calling thread waiting for it. Under MPI_THREAD_SERIALIZED only one thread may be inside MPI at
// a time: a collective the compute thread needs at once (tensor parallelism's all-reduces inside
// forward and backward) must queue behind the gradient buckets the thread is reducing, and not
// enter MPI beside them. Tasks run in posting order, so ranks that post the same calls in the
// same order still match.
#pragma once
#include <memory>

#include "core/comm.h"
#include "parallel/comm_thread.h"

namespace moetrain {

// inner's collectives, each run on `thread` (which must outlive the result). Point-to-point and
// communicator splits are not offered (nothing needs them here): they throw.
std::unique_ptr<Comm> comm_on_thread(std::unique_ptr<Comm> inner, CommThread& thread);

}  // namespace moetrain
