// The memory this process may use on its machine (/proc/meminfo, memory cgroups): what the
// start-up memory check (train/memory_estimate.h, check_memory) compares the estimate with.
#pragma once
#include <string>

namespace moetrain {

// What this process may use: /proc/meminfo's MemAvailable, or its memory cgroup's limit less its
// usage when lower (cgroup v2 memory.max; v1 memory.limit_in_bytes of the group /proc/self/cgroup
// names and of its parents). `source` says which; `own_group`, whether that limit is a cgroup's
// holding this process alone (a memory cgroup per rank). < 0 when neither can be read.
double available_memory(std::string* source = nullptr, bool* own_group = nullptr);

}  // namespace moetrain
