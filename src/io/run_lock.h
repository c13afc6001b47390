// An advisory lock on a run directory: two runs writing one directory (two `train --resume` on
// it, say) would interleave their metrics and checkpoints, so the second one stops before it
// touches anything. The lock is flock(2) on RUN_DIR/.lock, which the kernel drops when the
// holding process ends however it ends (kill -9 included), so a crashed run never leaves the
// directory locked. The file stays behind; its contents (the holder's pid and host) only name
// the holder in the message a refused run prints.
#pragma once
#include <filesystem>

#include "core/comm.h"

namespace moetrain {

class RunLock {
 public:
  RunLock() = default;  // holds nothing
  // Locks run_dir (which must exist), or throws naming the holder's pid and host.
  explicit RunLock(const std::filesystem::path& run_dir);
  ~RunLock();
  RunLock(RunLock&& other) noexcept;
  RunLock& operator=(RunLock&& other) noexcept;
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Collective over control: rank 0 creates run_dir and locks it; every rank returns (only rank
// 0's lock holds anything) or every rank throws rank 0's message, so none is left waiting in a
// later collective. Only rank 0 locks: it writes the run's shared files (config, metrics, the
// checkpoint commit), and the ranks of one run, on one machine, would refuse each other.
RunLock lock_run_dir(const std::filesystem::path& run_dir, Comm& control);

// The error of a fresh run (no --resume) on a directory that holds an earlier run's checkpoints:
// hours of training are not overwritten; it names --resume and the other ways out.
[[noreturn]] void refuse_earlier_run(const std::filesystem::path& run_dir);

}  // namespace moetrain
