// `moetrain version`: what this build is and what it runs on.
#include <fmt/format.h>

#ifdef MOETRAIN_WITH_MPI
#include <mpi.h>
#endif
#ifdef MOETRAIN_WITH_ZMQ
#include <zmq.h>
#endif

#include "app/commands.h"
#include "core/build_info.h"
#include "core/threads.h"
#include "kernels/gemm.h"

namespace moetrain::app {

Run add_version_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "version", "Print the version, the GEMM backend and its ISA, MPI, ZeroMQ, threads");
  (void)cmd;
  return [] {
    fmt::print("moetrain {} (commit {})\n", build_version(), build_commit());
    fmt::print("gemm: {}\n", gemm_backend_info());
#ifdef MOETRAIN_WITH_MPI
    char lib[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(lib, &len);
    std::string mpi(lib, len);
    if (auto nl = mpi.find(','); nl != std::string::npos) mpi.resize(nl);
    fmt::print("mpi: {} (MPI {}.{})\n", mpi, MPI_VERSION, MPI_SUBVERSION);
#else
    fmt::print("mpi: not built (MOETRAIN_WITH_MPI=OFF)\n");
#endif
#ifdef MOETRAIN_WITH_ZMQ
    int major = 0, minor = 0, patch = 0;
    zmq_version(&major, &minor, &patch);
    fmt::print("zeromq: {}.{}.{}\n", major, minor, patch);
#else
    fmt::print("zeromq: not built (MOETRAIN_WITH_ZMQ=OFF)\n");
#endif
    fmt::print("threads: {} (hardware cores: {})\n", init_threads(), hardware_cores());
    return 0;
  };
}

}  // namespace moetrain::app
