// What a run records of the program and the machine that made it: the version, the commit the
// build was configured at, and the CPU. Checkpoints carry it (trainer_state.json "written_by"),
// the report's header shows it.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace moetrain {

// "0.1.0"
const char* build_version();
// The git commit the build was configured at ("unknown" outside a git checkout); "-dirty" when
// the tree had uncommitted changes then.
const char* build_commit();
// /proc/cpuinfo's model name of this machine ("unknown" where it has none).
std::string host_cpu_model();
// {"moetrain": version, "commit": ..., "cpu": ..., "host": hostname}
nlohmann::json written_by();

}  // namespace moetrain
