#include "core/build_info.h"

#include <unistd.h>

#include <fstream>

#ifndef MOETRAIN_COMMIT
#define MOETRAIN_COMMIT "unknown"
#endif

namespace moetrain {

const char* build_version() {
  return MOETRAIN_VERSION;
}

const char* build_commit() {
  return MOETRAIN_COMMIT;
}

std::string host_cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.starts_with("model name")) {
      const auto colon = line.find(':');
      const auto start = colon == std::string::npos ? colon : line.find_first_not_of(' ', colon + 1);
      if (start != std::string::npos) return line.substr(start);
    }
  return "unknown";
}

nlohmann::json written_by() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  return {{"moetrain", build_version()},
          {"commit", build_commit()},
          {"cpu", host_cpu_model()},
          {"host", std::string(host)}};
}

}  // namespace moetrain
