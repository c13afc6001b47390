#include "ps/job_dir.h"


namespace fs = std::filesystem;

namespace moetrain::ps {

bool holds_earlier_run(const fs::path& run_dir) {
  if (fs::exists(run_dir / "checkpoints")) return true;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir / "ps", ec))
    if (e.is_directory() && e.path().filename().string().starts_with("server_")) return true;
  return false;
}

RunLock open_job_dir(const fs::path& run_dir, bool resume) {
  fs::create_directories(run_dir);
  RunLock lock(run_dir);
  if (!resume && holds_earlier_run(run_dir)) refuse_earlier_run(run_dir);
  return lock;
}

}  // namespace moetrain::ps
