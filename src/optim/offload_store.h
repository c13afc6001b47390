// Optimizer state in a file on local disk instead of in memory (dist.offload = host_file). The
// file holds, for each piece of a ShardedOptimizer and each of its state buffers, one region of
// the piece's size (f32, each region starting on a page boundary). A step streams the pieces in
// order in chunks through a ring of three buffers: an I/O thread reads chunk i+1 ahead while the
// optimizer updates chunk i, and writes chunk i−1 back behind it. Written ranges are flushed
// (sync_file_range) and dropped from the page cache (posix_fadvise DONTNEED) two chunks later, so
// neither the process nor its page cache holds more than a few chunks of state: a memory cgroup
// charges dirty file pages to the process, and would otherwise fill with them.
//
// Checkpoints copy the state in and out with read() and write() (pread / pwrite of the range
// asked for, its pages flushed and dropped after), so a checkpoint of any size keeps only its
// caller's window resident. Moment averaging and a device's state transfer work on the state in
// place through map(): the whole file mapped shared until the next stream() (which unmaps it and
// drops its pages first).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace moetrain {

class OffloadStore {
 public:
  // Creates (or truncates) `path`, reserves its size (an error names the path when the disk has
  // no room) and fills each state buffer with its initial value. piece_sizes: elements per piece;
  // initial: one value per state buffer. chunk: elements per state buffer in one chunk.
  OffloadStore(std::string path, std::vector<int64_t> piece_sizes, std::vector<float> initial,
               int64_t chunk = int64_t{1} << 20);
  ~OffloadStore();  // removes the file
  OffloadStore(const OffloadStore&) = delete;
  OffloadStore& operator=(const OffloadStore&) = delete;

  // Calls fn(piece, lo, hi, state) for every chunk [lo, hi) of every piece, pieces and chunks in
  // order; state[s] holds elements lo..hi of buffer s of the piece, and what fn leaves there is
  // written back. Returns when every chunk is written. An I/O error is an Error naming the file.
  using ChunkFn = std::function<void(std::size_t piece, int64_t lo, int64_t hi, float* const* state)>;
  void stream(const ChunkFn& fn);

  // Buffer s of `piece`, mapped from the file (writes go to the file); valid until the next
  // stream() or unmap().
  std::span<float> map(std::size_t piece, int s);
  // Unmaps the file, flushes it and drops its pages from the page cache.
  void unmap();
  // Copies elements [at, at + n) of buffer s of `piece` out of the file, or into it; the range's
  // pages are flushed and dropped from the page cache after. Not while a stream() runs.
  void read(std::size_t piece, int s, int64_t at, int64_t n, float* out);
  void write(std::size_t piece, int s, int64_t at, int64_t n, const float* in);

  const std::string& path() const { return path_; }
  int64_t file_bytes() const { return file_bytes_; }
  int64_t chunk() const { return chunk_; }
  // Bytes of the ring of chunk buffers (what a step keeps resident).
  int64_t ring_bytes() const { return ring_bytes(n_state_, chunk_); }
  // The same for a store of n_state buffers in chunks of `chunk` elements (the memory estimate).
  static int64_t ring_bytes(int n_state, int64_t chunk = int64_t{1} << 20);

 private:
  struct Io;
  int64_t region(std::size_t piece, int s) const;  // byte offset of the region
  // The byte offset of elements [at, at + n) of buffer s of a piece; throws naming them when
  // they are not in the store.
  int64_t range_offset(std::size_t piece, int s, int64_t at, int64_t n) const;
  void drop(int64_t offset, int64_t bytes) const;  // flush and drop from the page cache

  std::string path_;
  std::vector<int64_t> sizes_;
  int n_state_;
  int64_t chunk_;
  std::vector<int64_t> piece_offset_;  // byte offset of each piece's first region
  std::vector<int64_t> region_bytes_;  // per piece: one region's bytes, page-rounded
  int64_t file_bytes_ = 0;
  int fd_ = -1;
  void* map_ = nullptr;
  std::unique_ptr<Io> io_;
};

}  // namespace moetrain
