#include "io/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "core/check.h"

namespace moetrain {

namespace fs = std::filesystem;

namespace {

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "unknown host";
  return buf;
}

// What the holder wrote: "pid <n> on <host>", or a note when it wrote nothing yet.
std::string holder(int fd) {
  std::string text(256, '\0');
  ssize_t n = pread(fd, text.data(), text.size(), 0);
  text.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
  return text.empty() ? "another process (which has not yet written its pid)" : text;
}

}  // namespace

RunLock::RunLock(const fs::path& run_dir) {
  const fs::path path = run_dir / ".lock";
  // No O_TRUNC: a refused run must leave the holder's pid in place.
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  MOETRAIN_CHECK(fd >= 0, "cannot open {} to lock the run directory: {}", path.string(),
                 std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string who = err == EWOULDBLOCK ? holder(fd) : std::string();
    ::close(fd);
    MOETRAIN_CHECK(err != EWOULDBLOCK,
                   "{} is in use by {}: another run is writing this run directory; wait for it "
                   "to end (or stop it), or choose another train.run_dir",
                   run_dir.string(), who);
    MOETRAIN_FAIL("cannot lock {}: {}", path.string(), std::strerror(err));
  }
  const std::string me = fmt::format("pid {} on {}\n", static_cast<long>(::getpid()), host_name());
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
    const int err = errno;
    ::close(fd);
    MOETRAIN_FAIL("cannot write {}: {}", path.string(), std::strerror(err));
  }
  fd_ = fd;
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

RunLock::RunLock(RunLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

RunLock& RunLock::operator=(RunLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

RunLock lock_run_dir(const fs::path& run_dir, Comm& control) {
  if (control.size() == 1) {
    fs::create_directories(run_dir);
    return RunLock(run_dir);
  }
  RunLock lock;
  std::string error;
  if (control.rank() == 0) {
    try {
      fs::create_directories(run_dir);
      lock = RunLock(run_dir);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  int64_t n = static_cast<int64_t>(error.size());
  control.broadcast(&n, sizeof n);
  error.resize(static_cast<std::size_t>(n));
  if (n > 0) control.broadcast(error.data(), n);
  MOETRAIN_CHECK(error.empty(), "{}", error);
  return lock;
}

void refuse_earlier_run(const fs::path& run_dir) {
  MOETRAIN_FAIL(
      "train.run_dir = '{}' already holds a run's checkpoints: pass --resume to continue it, or "
      "choose another train.run_dir (or remove that one)",
      run_dir.string());
}

}  // namespace moetrain
