// The processes a launcher forks from this binary (or from a launcher on PATH, such as mpirun) and
// supervises: starting them, describing how they ended, stopping them, listing them in a file.
#pragma once
#include <sys/types.h>

#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

namespace moetrain::app {

struct Child {
  std::string name;
  pid_t pid = -1;
  bool running = true;
  int status = 0;  // waitpid's, once it ended
};

// Starts args as a child in its own process group that dies with the launcher. args[0]
// "moetrain" is this binary; with on_path, args[0] is looked up on PATH (mpirun). OMP_NUM_THREADS
// is set to omp_threads unless the launcher's environment sets it.
pid_t spawn(const std::vector<std::string>& args, int omp_threads, bool on_path = false);

// "exited with code N", "was killed by signal N".
std::string describe_status(int status);
bool exited_ok(int status);

// Marks the children that ended, from `from` on; returns whether any of them is still running.
bool reap(std::vector<Child>& children, std::size_t from = 0);
// Waits up to `seconds` for the children from `from` on to end by themselves.
void wait_until_ended(std::vector<Child>& children, std::size_t from, double seconds);
// SIGTERM to every running child, SIGKILL to those still running 5 s later.
void kill_all(std::vector<Child>& children);

// `file` (JSON): the launcher's pid and every child by name, pid and whether it runs.
void write_pids(const std::filesystem::path& file, const std::vector<Child>& children);

}  // namespace moetrain::app
