#include "parallel/runtime.h"

#include <cstdlib>

#include "core/log.h"

#if MOETRAIN_WITH_MPI
#include "parallel/comm_mpi.h"
#endif

namespace moetrain {

void dist_init(int* argc, char*** argv) {
#if MOETRAIN_WITH_MPI
  if (mpi::launched()) {
    mpi::initialize(argc, argv);
    set_log_rank(dist_world("log")->rank());
  }
#else
  (void)argc, (void)argv;
#endif
}

bool dist_mpi_active() {
#if MOETRAIN_WITH_MPI
  return mpi::initialized();
#else
  return false;
#endif
}

std::unique_ptr<Comm> dist_world(const std::string& name) {
#if MOETRAIN_WITH_MPI
  if (mpi::initialized()) return mpi::world(name);
#endif
  return make_local_comm(name);
}

int dist_local_size() {
#if MOETRAIN_WITH_MPI
  if (mpi::initialized()) return mpi::local_size();
#endif
  return 1;
}

void dist_finalize() {
#if MOETRAIN_WITH_MPI
  mpi::finalize();
#endif
}

void dist_abort(int code) {
#if MOETRAIN_WITH_MPI
  mpi::abort(code);
#else
  std::exit(code);
#endif
}

}  // namespace moetrain
