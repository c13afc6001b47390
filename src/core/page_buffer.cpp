#include "core/page_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "core/check.h"

namespace moetrain {

std::size_t PageBuffer::page_bytes() {
  static const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

PageBuffer::PageBuffer(int64_t n) : n_(n) {
  MOETRAIN_CHECK(n >= 0, "page buffer of {} floats", n);
  if (n == 0) return;
  const std::size_t page = page_bytes();
  bytes_ = (static_cast<std::size_t>(n) * sizeof(float) + page - 1) / page * page;
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  MOETRAIN_CHECK(p != MAP_FAILED, "mapping {} bytes for a page buffer: {}", bytes_,
                 std::strerror(errno));
  data_ = static_cast<float*>(p);
  // Fresh anonymous pages read zero and are not resident: they count as released, so the first
  // zero() does not fault the whole buffer in.
  released_.assign(bytes_ / page, 1);
}

PageBuffer::~PageBuffer() {
  if (data_) munmap(data_, bytes_);
}

PageBuffer::PageBuffer(PageBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      n_(std::exchange(o.n_, 0)),
      bytes_(std::exchange(o.bytes_, 0)),
      released_(std::move(o.released_)) {}

PageBuffer& PageBuffer::operator=(PageBuffer&& o) noexcept {
  if (this != &o) {
    if (data_) munmap(data_, bytes_);
    data_ = std::exchange(o.data_, nullptr);
    n_ = std::exchange(o.n_, 0);
    bytes_ = std::exchange(o.bytes_, 0);
    released_ = std::move(o.released_);
  }
  return *this;
}

int64_t release_whole_pages(void* p, int64_t bytes) {
  if (bytes <= 0) return 0;
  const std::size_t page = PageBuffer::page_bytes();
  const auto lo = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t hi = lo + static_cast<std::size_t>(bytes);
  const std::uintptr_t first = (lo + page - 1) / page * page, last = hi / page * page;
  if (first >= last) return 0;
  const int rc = madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
  MOETRAIN_CHECK(rc == 0, "releasing {} bytes of pages: {}", last - first, std::strerror(errno));
  return static_cast<int64_t>(last - first);
}

int64_t PageBuffer::clear(int64_t offset, int64_t n) {
  MOETRAIN_CHECK(offset >= 0 && n >= 0 && offset + n <= n_,
                 "page buffer range [{}, +{}) outside its {} floats", offset, n, n_);
  if (n == 0) return 0;
  const std::size_t page = page_bytes();
  const std::size_t lo = static_cast<std::size_t>(offset) * sizeof(float);
  const std::size_t hi = static_cast<std::size_t>(offset + n) * sizeof(float);
  const std::size_t first = (lo + page - 1) / page, last = hi / page;  // whole pages [first, last)
  auto* base = reinterpret_cast<char*>(data_);
  if (first >= last) {
    std::memset(base + lo, 0, hi - lo);
    return 0;
  }
  std::memset(base + lo, 0, first * page - lo);
  std::memset(base + last * page, 0, hi - last * page);
  const int rc = madvise(base + first * page, (last - first) * page, MADV_DONTNEED);
  MOETRAIN_CHECK(rc == 0, "releasing {} pages of a page buffer: {}", last - first,
                 std::strerror(errno));
  std::fill(released_.begin() + static_cast<std::ptrdiff_t>(first),
            released_.begin() + static_cast<std::ptrdiff_t>(last), uint8_t{1});
  return static_cast<int64_t>((last - first) * page);
}

void PageBuffer::zero() {
  const std::size_t page = page_bytes();
  const std::size_t pages = released_.size();
  auto* base = reinterpret_cast<char*>(data_);
  for (std::size_t p = 0; p < pages;) {
    if (released_[p]) {
      released_[p++] = 0;
      continue;
    }
    std::size_t q = p;
    while (q < pages && !released_[q]) ++q;
    std::memset(base + p * page, 0, (q - p) * page);
    p = q;
  }
}

int64_t PageBuffer::released_pages() const {
  return static_cast<int64_t>(std::count(released_.begin(), released_.end(), uint8_t{1}));
}

}  // namespace moetrain
