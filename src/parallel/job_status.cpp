// What the supervisor reads before and after an attempt (parallel/supervisor.h): the slots it
// can run on, and how a job ended, from its wait status and from what mpirun and the ranks
// printed.
#include "parallel/supervisor.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include "core/check.h"
#include "parallel/watchdog.h"

namespace moetrain {

int hostfile_slots(const std::string& path) {
  std::ifstream in(path);
  MOETRAIN_CHECK(in.good(), "hostfile '{}' cannot be read: {}", path, std::strerror(errno));
  int total = 0, line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    std::string host, word;
    if (!(words >> host)) continue;
    int slots = 1;
    while (words >> word) {
      const std::size_t eq = word.find('=');
      const std::string key = word.substr(0, eq);
      if (key != "slots" && key != "max_slots" && key != "max-slots") {
        MOETRAIN_FAIL(
            "hostfile '{}' line {}: '{}' unknown (expected: host [slots=N] [max_slots=M])", path,
            line_no, word);
      }
      const std::string value = eq == std::string::npos ? "" : word.substr(eq + 1);
      char* end = nullptr;
      const long v = std::strtol(value.c_str(), &end, 10);
      MOETRAIN_CHECK(!value.empty() && *end == '\0' && v >= 0 && v <= 1'000'000,
                     "hostfile '{}' line {}: {} = '{}' must be a count ≥ 0", path, line_no, key,
                     value);
      if (key == "slots") slots = static_cast<int>(v);
    }
    total += slots;
  }
  return total;
}

int machine_slots() {
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

std::string mpirun_refusal(const std::string& output) {
  if (output.find("detected an attempt to run as root") != std::string::npos)
    return "mpirun refuses to run as root: pass --mpi-arg=--allow-run-as-root (or set "
           "OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)";
  const auto line_at = [&](std::size_t at) {
    return output.substr(at, output.find('\n', at) - at);
  };
  // "mpirun: Error: unknown option "--bogus"".
  if (const std::size_t at = output.find("mpirun: Error: "); at != std::string::npos)
    return line_at(at);
  if (output.find("could not access\nor execute an executable") != std::string::npos) {
    const std::size_t at = output.find("Executable: ");
    return "mpirun could not access or execute the program" +
           (at == std::string::npos ? std::string() : " (" + line_at(at) + ")");
  }
  return "";
}

std::string job_error(const std::string& output) {
  const std::string mark = "moetrain: error: ";
  const std::size_t at = output.find(mark);
  if (at == std::string::npos) return "";
  const std::size_t from = at + mark.size();
  return output.substr(from, output.find('\n', from) - from);
}

std::string describe_job_status(int status) {
  if (WIFSIGNALED(status))
    return fmt::format("mpirun died of signal {} ({})", WTERMSIG(status),
                       strsignal(WTERMSIG(status)));
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code == 0) return "completed";
  if (code == kCollectiveTimeoutExit)
    return fmt::format(
        "exit code {}: the collective watchdog aborted the job (a collective waited "
        "past dist.collective_timeout)",
        code);
  if (code > 128 && code < 128 + NSIG)
    return fmt::format("exit code {}: a process died of signal {} ({})", code, code - 128,
                       strsignal(code - 128));
  return fmt::format("exit code {}", code);
}

}  // namespace moetrain
