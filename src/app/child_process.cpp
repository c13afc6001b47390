#include "app/child_process.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/file.h"

namespace moetrain::app {

pid_t spawn(const std::vector<std::string>& args, int omp_threads, bool on_path) {
  std::vector<char*> argv;
  for (const auto& s : args) argv.push_back(const_cast<char*>(s.c_str()));
  argv.push_back(nullptr);
  const std::string threads = std::to_string(omp_threads);
  pid_t pid = fork();
  MOETRAIN_CHECK(pid >= 0, "fork failed: {}", std::strerror(errno));
  if (pid == 0) {
    // A job's processes never outlive the launcher, and a terminal's Ctrl-C reaches the launcher
    // alone (their own process group): the launcher decides how the job stops.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    setpgid(0, 0);
    // The mask survives exec: a child forked while the stop signals are blocked here
    // (StopSignals) would never see them.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (getenv("OMP_NUM_THREADS") == nullptr) setenv("OMP_NUM_THREADS", threads.c_str(), 1);
    if (on_path) execvp(argv[0], argv.data());
    else execv("/proc/self/exe", argv.data());
    std::fprintf(stderr, "moetrain: cannot exec %s: %s\n", on_path ? argv[0] : "/proc/self/exe",
                 std::strerror(errno));
    _exit(127);
  }
  return pid;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {}", WTERMSIG(status));
  return "ended";
}

bool exited_ok(int status) {
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

bool reap(std::vector<Child>& children, std::size_t from) {
  bool left = false;
  for (std::size_t k = from; k < children.size(); ++k) {
    Child& c = children[k];
    if (c.running && waitpid(c.pid, &c.status, WNOHANG) == c.pid) c.running = false;
    left = left || c.running;
  }
  return left;
}

void wait_until_ended(std::vector<Child>& children, std::size_t from, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (reap(children, from) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

void kill_all(std::vector<Child>& children) {
  for (auto& c : children)
    if (c.running) kill(c.pid, SIGTERM);
  wait_until_ended(children, 0, 5.0);
  for (auto& c : children)
    if (c.running) {
      kill(c.pid, SIGKILL);
      waitpid(c.pid, &c.status, 0);
      c.running = false;
    }
}

void write_pids(const std::filesystem::path& file, const std::vector<Child>& children) {
  nlohmann::json procs = nlohmann::json::array();
  for (const auto& c : children)
    procs.push_back({{"name", c.name}, {"pid", c.pid}, {"running", c.running}});
  const nlohmann::json j = {{"launcher", static_cast<int64_t>(::getpid())}, {"processes", procs}};
  write_file_atomic(file, j.dump(2) + "\n");
}

}  // namespace moetrain::app
