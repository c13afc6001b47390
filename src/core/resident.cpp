#include "core/resident.h"

#include <fstream>
#include <sstream>
#include <string>

namespace moetrain {

ResidentMemory resident_memory() {
  ResidentMemory m;
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    double* to = line.rfind("VmRSS:", 0) == 0   ? &m.rss
                 : line.rfind("VmHWM:", 0) == 0 ? &m.peak
                                                : nullptr;
    if (to == nullptr) continue;
    std::istringstream s(line.substr(6));
    double kb = 0;
    if (s >> kb) *to = kb * 1024;  // the kernel writes kB (KiB)
  }
  return m;
}

}  // namespace moetrain
