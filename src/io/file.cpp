#include "io/file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "core/check.h"

namespace moetrain {

namespace {

std::string errno_text() {
  return std::strerror(errno);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// MappedFile

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MOETRAIN_CHECK(fd >= 0, "cannot open '{}' for reading: {}", path.string(), errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string why = errno_text();
    ::close(fd);
    MOETRAIN_FAIL("cannot stat '{}': {}", path.string(), why);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    MOETRAIN_FAIL("'{}' is not a regular file", path.string());
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      std::string why = errno_text();
      ::close(fd);
      MOETRAIN_FAIL("cannot map '{}' ({} bytes): {}", path.string(), size_, why);
    }
    data_ = static_cast<const uint8_t*>(p);
    mapped_ = true;
  }
  ::close(fd);  // the mapping outlives the descriptor
}

MappedFile::~MappedFile() {
  release();
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, false)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, false);
  }
  return *this;
}

void MappedFile::hand_back(const uint8_t* from, std::size_t n) const {
  if (!mapped_ || n == 0) return;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(from) + page - 1) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(from) + n) / page * page;
  // Advice only: a failure leaves the pages resident, which is what happens without it.
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

void MappedFile::release() {
  if (mapped_) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
  mapped_ = false;
}

// ---------------------------------------------------------------------------------------------
// AtomicFileWriter

AtomicFileWriter::AtomicFileWriter(std::filesystem::path path) : path_(std::move(path)) {
  tmp_ = path_;
  tmp_ += ".tmp";
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MOETRAIN_CHECK(fd_ >= 0, "cannot create '{}': {}", tmp_.string(), errno_text());
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFileWriter::write(const void* data, std::size_t n) {
  MOETRAIN_CHECK(fd_ >= 0, "write to '{}' after commit", path_.string());
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    // Linux moves at most ~2 GiB per call; partial writes are normal for big tensors.
    ssize_t w = ::write(fd_, p, std::min<std::size_t>(n, std::size_t{1} << 30));
    if (w < 0 && errno == EINTR) continue;
    MOETRAIN_CHECK(w > 0, "cannot write '{}': {}", tmp_.string(),
                   w < 0 ? errno_text() : "no progress");
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

void AtomicFileWriter::commit() {
  MOETRAIN_CHECK(fd_ >= 0, "'{}' committed twice", path_.string());
  MOETRAIN_CHECK(::fsync(fd_) == 0, "cannot fsync '{}': {}", tmp_.string(), errno_text());
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) {
    std::string why = errno_text();
    ::unlink(tmp_.c_str());
    MOETRAIN_FAIL("cannot close '{}': {}", tmp_.string(), why);
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    std::string why = errno_text();
    ::unlink(tmp_.c_str());
    MOETRAIN_FAIL("cannot rename '{}' to '{}': {}", tmp_.string(), path_.string(), why);
  }
  // The rename is only durable once the directory entry is.
  std::filesystem::path dir = path_.parent_path();
  if (dir.empty()) dir = ".";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MOETRAIN_CHECK(dfd >= 0, "cannot open directory '{}' to fsync it: {}", dir.string(),
                 errno_text());
  rc = ::fsync(dfd);
  std::string why = rc != 0 ? errno_text() : "";
  ::close(dfd);
  MOETRAIN_CHECK(rc == 0, "cannot fsync directory '{}': {}", dir.string(), why);
}

void append_whole(int fd, const std::filesystem::path& path, std::string_view bytes) {
  const off_t start = ::lseek(fd, 0, SEEK_END);
  MOETRAIN_CHECK(start >= 0, "cannot write {}: {}", path.string(), errno_text());
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string why = w < 0 ? errno_text() : std::string("no progress");
      // Best effort: the error below is what matters, and a file that cannot shrink keeps a tail.
      [[maybe_unused]] const int rc = ::ftruncate(fd, start);
      MOETRAIN_FAIL("cannot write {}: {} (the run stops; the file ends at its last whole entry)",
                    path.string(), why);
    }
    done += static_cast<std::size_t>(w);
  }
}

void write_file_atomic(const std::filesystem::path& path, std::string_view bytes) {
  AtomicFileWriter w(path);
  w.write(bytes.data(), bytes.size());
  w.commit();
}

}  // namespace moetrain
