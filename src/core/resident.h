// This process's resident memory as the kernel counts it (/proc/self/status): VmRSS, the pages
// resident now, and VmHWM, the most that were resident at once since the process started.
#pragma once

namespace moetrain {

struct ResidentMemory {
  double rss = -1;   // bytes resident now; < 0 where /proc/self/status cannot be read
  double peak = -1;  // bytes resident at the high-water mark
};

// Reads /proc/self/status (a few microseconds: call it at metrics intervals, not per kernel).
ResidentMemory resident_memory();

}  // namespace moetrain
