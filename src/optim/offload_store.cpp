#include "optim/offload_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "core/check.h"

namespace moetrain {

namespace {

constexpr int64_t kPage = 4096;
constexpr int kRing = 3;  // chunk i−1 being written, i being updated, i+1 being read
// Chunks written but not yet flushed and dropped: their write-back runs in the background while
// later chunks are updated.
constexpr std::size_t kInFlight = 2;

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

std::string errno_text() { return std::strerror(errno); }

}  // namespace

struct OffloadStore::Io {
  struct Job {
    enum Kind { Read, Write, Flush } kind;
    int slot = 0;
    std::size_t piece = 0;
    int64_t lo = 0, hi = 0;
  };
  std::vector<std::vector<float>> slots;  // kRing × (n_state · chunk)
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Job> jobs;
  bool stop = false;
  int64_t reads_done = 0, flushes_done = 0;
  std::string error;                           // the first I/O error of this stream
  std::deque<std::pair<int64_t, int64_t>> written;  // (offset, bytes) not yet dropped
  std::thread thread;
};

OffloadStore::OffloadStore(std::string path, std::vector<int64_t> piece_sizes,
                           std::vector<float> initial, int64_t chunk)
    : path_(std::move(path)),
      sizes_(std::move(piece_sizes)),
      n_state_(static_cast<int>(initial.size())),
      chunk_(chunk) {
  MOETRAIN_CHECK(chunk_ > 0 && chunk_ % (kPage / 4) == 0,
                 "offload store: chunk of {} elements must be a positive multiple of {}", chunk_,
                 kPage / 4);
  for (int64_t n : sizes_) {
    MOETRAIN_CHECK(n >= 0, "offload store: piece of {} elements", n);
    piece_offset_.push_back(file_bytes_);
    region_bytes_.push_back(round_up(n * 4, kPage));
    file_bytes_ += region_bytes_.back() * n_state_;
  }
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  MOETRAIN_CHECK(fd_ >= 0, "dist.offload: cannot create the optimizer state file {}: {}", path_,
                 errno_text());
  if (file_bytes_ > 0) {
    const int rc = ::posix_fallocate(fd_, 0, file_bytes_);
    if (rc != 0) {
      ::close(fd_), ::unlink(path_.c_str());
      MOETRAIN_FAIL("dist.offload: cannot reserve {} MiB for the optimizer state in {}: {}",
                    file_bytes_ >> 20, path_, std::strerror(rc));
    }
  }
  io_ = std::make_unique<Io>();
  io_->slots.assign(kRing, std::vector<float>(static_cast<std::size_t>(n_state_ * chunk_)));
  io_->thread = std::thread([this] {
    Io& io = *io_;
    for (;;) {
      std::unique_lock lock(io.mu);
      io.cv.wait(lock, [&] { return io.stop || !io.jobs.empty(); });
      if (io.jobs.empty()) return;  // stopping, nothing left
      const Io::Job job = io.jobs.front();
      io.jobs.pop_front();
      const bool failed = !io.error.empty();
      lock.unlock();
      std::string error;
      if (job.kind == Io::Job::Flush) {
        for (auto [off, bytes] : io.written) drop(off, bytes);
        io.written.clear();
      } else if (!failed) {
        float* base = io.slots[static_cast<std::size_t>(job.slot)].data();
        const int64_t bytes = (job.hi - job.lo) * 4;
        for (int s = 0; s < n_state_ && error.empty(); ++s) {
          const int64_t off = region(job.piece, s) + job.lo * 4;
          char* buf = reinterpret_cast<char*>(base + s * chunk_);
          for (int64_t done = 0; done < bytes;) {
            const ssize_t n = job.kind == Io::Job::Read
                                  ? ::pread(fd_, buf + done, static_cast<size_t>(bytes - done),
                                            off + done)
                                  : ::pwrite(fd_, buf + done, static_cast<size_t>(bytes - done),
                                             off + done);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
              error = fmt::format("dist.offload: {} {} bytes at {} of {}: {}",
                                  job.kind == Io::Job::Read ? "reading" : "writing",
                                  bytes - done, off + done, path_,
                                  n < 0 ? errno_text() : std::string("end of file"));
              break;
            }
            done += n;
          }
          if (job.kind == Io::Job::Write && error.empty()) {
            // Start the write-back now; wait for it and drop the pages kInFlight chunks later.
            ::sync_file_range(fd_, off, bytes, SYNC_FILE_RANGE_WRITE);
            io.written.emplace_back(off, bytes);
          }
        }
        while (io.written.size() > kInFlight * static_cast<std::size_t>(n_state_)) {
          drop(io.written.front().first, io.written.front().second);
          io.written.pop_front();
        }
      }
      lock.lock();
      if (!error.empty() && io.error.empty()) io.error = error;
      if (job.kind == Io::Job::Read) ++io.reads_done;
      if (job.kind == Io::Job::Flush) ++io.flushes_done;
      io.cv.notify_all();
    }
  });
  // Initial values other than zero (fallocate reads as zeros) are written through the ring.
  if (std::any_of(initial.begin(), initial.end(), [](float v) { return v != 0.0f; })) {
    stream([&](std::size_t, int64_t lo, int64_t hi, float* const* state) {
      for (int s = 0; s < n_state_; ++s) std::fill(state[s], state[s] + (hi - lo), initial[s]);
    });
  }
}

OffloadStore::~OffloadStore() {
  if (io_) {
    {
      std::lock_guard lock(io_->mu);
      io_->stop = true;
    }
    io_->cv.notify_all();
    io_->thread.join();
  }
  if (map_) ::munmap(map_, static_cast<size_t>(file_bytes_));
  if (fd_ >= 0) ::close(fd_);
  ::unlink(path_.c_str());
}

int64_t OffloadStore::region(std::size_t piece, int s) const {
  return piece_offset_[piece] + region_bytes_[piece] * s;
}

int64_t OffloadStore::ring_bytes(int n_state, int64_t chunk) {
  return int64_t{kRing} * n_state * chunk * 4;
}

void OffloadStore::drop(int64_t offset, int64_t bytes) const {
  ::sync_file_range(fd_, offset, bytes,
                    SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                        SYNC_FILE_RANGE_WAIT_AFTER);
  ::posix_fadvise(fd_, offset, bytes, POSIX_FADV_DONTNEED);
}

void OffloadStore::stream(const ChunkFn& fn) {
  unmap();
  struct Chunk {
    std::size_t piece;
    int64_t lo, hi;
  };
  std::vector<Chunk> chunks;
  for (std::size_t k = 0; k < sizes_.size(); ++k)
    for (int64_t lo = 0; lo < sizes_[k]; lo += chunk_)
      chunks.push_back({k, lo, std::min(lo + chunk_, sizes_[k])});
  if (chunks.empty() || n_state_ == 0) {
    for (const Chunk& c : chunks) fn(c.piece, c.lo, c.hi, nullptr);
    return;
  }
  Io& io = *io_;
  auto submit = [&](Io::Job::Kind kind, std::size_t i) {
    {
      std::lock_guard lock(io.mu);
      const Chunk& c = chunks[i];
      io.jobs.push_back({kind, static_cast<int>(i % kRing), c.piece, c.lo, c.hi});
    }
    io.cv.notify_all();
  };
  int64_t reads_before, flushes_before;
  {
    std::lock_guard lock(io.mu);
    reads_before = io.reads_done, flushes_before = io.flushes_done;
    io.error.clear();
  }
  // Waits until the I/O thread has finished every job (a flush is the last one).
  auto finish = [&] {
    {
      std::lock_guard lock(io.mu);
      io.jobs.push_back({Io::Job::Flush});
    }
    io.cv.notify_all();
    std::unique_lock lock(io.mu);
    io.cv.wait(lock, [&] { return io.flushes_done > flushes_before; });
    return io.error;
  };
  submit(Io::Job::Read, 0);
  if (chunks.size() > 1) submit(Io::Job::Read, 1);
  std::vector<float*> state(static_cast<std::size_t>(n_state_));
  try {
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      {
        std::unique_lock lock(io.mu);
        io.cv.wait(lock, [&] { return io.reads_done - reads_before > static_cast<int64_t>(i); });
        if (!io.error.empty()) break;
      }
      float* base = io.slots[i % kRing].data();
      for (int s = 0; s < n_state_; ++s) state[static_cast<std::size_t>(s)] = base + s * chunk_;
      fn(chunks[i].piece, chunks[i].lo, chunks[i].hi, state.data());
      // Slot (i+2) % kRing is chunk i−1's, whose write is queued before this read.
      submit(Io::Job::Write, i);
      if (i + 2 < chunks.size()) submit(Io::Job::Read, i + 2);
    }
  } catch (...) {
    finish();
    throw;
  }
  const std::string error = finish();
  MOETRAIN_CHECK(error.empty(), "{}", error);
}

std::span<float> OffloadStore::map(std::size_t piece, int s) {
  MOETRAIN_CHECK(piece < sizes_.size() && s >= 0 && s < n_state_,
                 "offload store: buffer {} of piece {} (of {} x {})", s, piece, sizes_.size(),
                 n_state_);
  if (sizes_[piece] == 0) return {};
  if (!map_) {
    void* m = ::mmap(nullptr, static_cast<size_t>(file_bytes_), PROT_READ | PROT_WRITE,
                     MAP_SHARED, fd_, 0);
    MOETRAIN_CHECK(m != MAP_FAILED, "dist.offload: cannot map {} ({} MiB): {}", path_,
                   file_bytes_ >> 20, errno_text());
    map_ = m;
  }
  return {reinterpret_cast<float*>(static_cast<char*>(map_) + region(piece, s)),
          static_cast<std::size_t>(sizes_[piece])};
}

namespace {

// Moves `bytes` between buf and the file at `off` with pread or pwrite, to the last byte.
void transfer(int fd, bool reading, char* buf, int64_t bytes, int64_t off,
              const std::string& path) {
  for (int64_t done = 0; done < bytes;) {
    const auto left = static_cast<size_t>(bytes - done);
    const ssize_t n = reading ? ::pread(fd, buf + done, left, off + done)
                              : ::pwrite(fd, buf + done, left, off + done);
    if (n < 0 && errno == EINTR) continue;
    MOETRAIN_CHECK(n > 0, "dist.offload: {} {} bytes at {} of {}: {}",
                   reading ? "reading" : "writing", bytes - done, off + done, path,
                   n < 0 ? errno_text() : std::string("end of file"));
    done += n;
  }
}

}  // namespace

int64_t OffloadStore::range_offset(std::size_t piece, int s, int64_t at, int64_t n) const {
  MOETRAIN_CHECK(piece < sizes_.size() && s >= 0 && s < n_state_ && at >= 0 && n >= 0 &&
                     at + n <= sizes_[piece],
                 "offload store: elements [{}, {}) of buffer {} of piece {} (of {} x {}, {} "
                 "elements)",
                 at, at + n, s, piece, sizes_.size(), n_state_,
                 piece < sizes_.size() ? sizes_[piece] : 0);
  return region(piece, s) + at * 4;
}

void OffloadStore::read(std::size_t piece, int s, int64_t at, int64_t n, float* out) {
  const int64_t off = range_offset(piece, s, at, n);
  if (n == 0) return;
  transfer(fd_, true, reinterpret_cast<char*>(out), n * 4, off, path_);
  ::posix_fadvise(fd_, off, n * 4, POSIX_FADV_DONTNEED);
}

void OffloadStore::write(std::size_t piece, int s, int64_t at, int64_t n, const float* in) {
  const int64_t off = range_offset(piece, s, at, n);
  if (n == 0) return;
  transfer(fd_, false, const_cast<char*>(reinterpret_cast<const char*>(in)), n * 4, off, path_);
  drop(off, n * 4);  // a memory cgroup charges dirty file pages to the process
}

void OffloadStore::unmap() {
  if (!map_) return;
  ::munmap(map_, static_cast<size_t>(file_bytes_));
  map_ = nullptr;
  drop(0, file_bytes_);
}

}  // namespace moetrain
