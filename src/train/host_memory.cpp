#include "train/host_memory.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>

namespace moetrain {

namespace {

// The first word of a file as a number; −1 when it cannot be read or says "max".
double read_number(const char* path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return -1;
  try {
    return std::stod(word);
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace

double available_memory(std::string* source, bool* own_group) {
  if (own_group) *own_group = false;
  double avail = -1;
  {
    std::ifstream in("/proc/meminfo");
    for (std::string line; std::getline(in, line);)
      if (line.rfind("MemAvailable:", 0) == 0) {
        std::istringstream s(line.substr(13));
        double kb = 0;
        if (s >> kb) avail = kb * 1024;
      }
  }
  if (source) *source = "MemAvailable in /proc/meminfo";
  double limit = read_number("/sys/fs/cgroup/memory.max");
  double used = read_number("/sys/fs/cgroup/memory.current");
  const char* cgroup = "the cgroup's memory.max";
  std::string limiting = "/sys/fs/cgroup";  // the directory of the group whose limit applies
  if (limit < 0) {
    // cgroup v1: this process's group ("N:memory:/path" in /proc/self/cgroup) and its parents;
    // the tightest limit less that group's usage.
    std::string group;
    std::ifstream in("/proc/self/cgroup");
    for (std::string line; std::getline(in, line);) {
      const std::size_t at = line.find(":memory:");
      if (at != std::string::npos) group = line.substr(at + 8);
    }
    const std::string root = "/sys/fs/cgroup/memory";
    double best = -1;
    for (std::string g = group;; g = g.substr(0, g.rfind('/'))) {
      const std::string dir = root + (g == "/" ? "" : g);
      const double lim = read_number((dir + "/memory.limit_in_bytes").c_str());
      const double use = read_number((dir + "/memory.usage_in_bytes").c_str());
      if (lim > 0 && lim < 1e18 && (best < 0 || lim - std::max(use, 0.0) < best - used)) {
        best = lim, used = use, limiting = dir;
      }
      if (g.empty() || g == "/") break;
    }
    limit = best;
    cgroup = "the memory cgroup's memory.limit_in_bytes";
  }
  // cgroup v1 writes "no limit" as a huge number.
  if (limit > 0 && limit < 1e18) {
    const double left = limit - std::max(used, 0.0);
    if (avail < 0 || left < avail) {
      avail = left;
      if (source) *source = cgroup;
      if (own_group) {
        // The processes in the group: this one alone means the limit is this rank's own.
        std::ifstream procs(limiting + "/cgroup.procs");
        int n = 0;
        for (std::string line; std::getline(procs, line);) n += !line.empty();
        *own_group = n == 1;
      }
    }
  }
  return avail;
}

}  // namespace moetrain
