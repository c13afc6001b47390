// A flat f32 buffer in page-aligned anonymous memory whose pages can be handed back to the system
// while it lives: release() drops the whole pages inside a range (madvise MADV_DONTNEED; they read
// zero afterwards and cost no memory until written again), and zero() clears the buffer without
// writing those pages back into residence. ZeRO-2 keeps its flat gradient buffer here: each
// bucket's pages are released once the bucket is reduced.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace moetrain {

// The whole pages inside [p, p + bytes) go back to the system (madvise MADV_DONTNEED; private
// anonymous memory, such as a large std::vector's, reads zero there afterwards); the partial pages
// at the ends are left as they are. Returns the bytes released.
int64_t release_whole_pages(void* p, int64_t bytes);

class PageBuffer {
 public:
  PageBuffer() = default;
  // n floats, zero; not resident until written (its pages count as released).
  explicit PageBuffer(int64_t n);
  ~PageBuffer();
  PageBuffer(PageBuffer&& o) noexcept;
  PageBuffer& operator=(PageBuffer&& o) noexcept;
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;

  float* data() { return data_; }
  const float* data() const { return data_; }
  int64_t size() const { return n_; }
  std::span<float> span() { return {data_, static_cast<std::size_t>(n_)}; }
  float& operator[](int64_t i) { return data_[i]; }
  float operator[](int64_t i) const { return data_[i]; }

  // Elements [offset, offset + n) read zero afterwards: the whole pages inside the range are
  // released, the rest (at most one partial page at each end) is set to zero. The caller writes
  // no element of the range between this call and the next zero() unless it calls clear() on it
  // again (zero() trusts released pages to read zero). Returns the bytes released. Safe to call
  // from another thread than the one writing elsewhere in the buffer, for disjoint ranges.
  int64_t clear(int64_t offset, int64_t n);
  // Every element = 0; pages released since the last zero() are skipped (they read zero already,
  // and writing them would fault them back in).
  void zero();
  // Pages released since the last zero().
  int64_t released_pages() const;
  static std::size_t page_bytes();

 private:
  float* data_ = nullptr;
  int64_t n_ = 0;
  std::size_t bytes_ = 0;          // mapped bytes, whole pages
  std::vector<uint8_t> released_;  // (pages) released since the last zero()
};

}  // namespace moetrain
