// PageBuffer: a cleared range reads zero, its whole pages leave the resident set, zero() keeps
// them out, and the rest of the buffer keeps its values.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "core/check.h"
#include "core/page_buffer.h"

using namespace moetrain;

namespace {

// Resident set of this process, kB (/proc/self/status).
int64_t vm_rss_kb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  return -1;
}

}  // namespace

TEST(PageBuffer, ClearedRangeReadsZeroAndLeavesTheResidentSet) {
  const int64_t page = static_cast<int64_t>(PageBuffer::page_bytes() / sizeof(float));
  const int64_t n = 16384 * page;  // 64 MiB with 4 KiB pages
  PageBuffer buf(n);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(buf.data()) % PageBuffer::page_bytes(), 0u);
  // A fresh buffer is not resident, and its first zero() leaves it so.
  EXPECT_EQ(buf.released_pages(), n / page);
  const int64_t fresh = vm_rss_kb();
  buf.zero();
  EXPECT_LT(vm_rss_kb(), fresh + 1024);
  EXPECT_EQ(buf.released_pages(), 0);
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(i % 1000) + 1.0f;
  const int64_t before = vm_rss_kb();
  ASSERT_GT(before, 0);
  // Not page-aligned at either end: the partial pages are zeroed, not released.
  const int64_t lo = 3 * page + 17, hi = n - 5 * page - 3;
  const int64_t released = buf.clear(lo, hi - lo);
  // Whole pages 4 .. n/page - 7.
  EXPECT_EQ(released, (n / page - 10) * page * static_cast<int64_t>(sizeof(float)));
  const int64_t after = vm_rss_kb();
  // At least 90% of the released bytes left the resident set (other allocations may move it a
  // little).
  EXPECT_LT(after, before - released / 1024 * 9 / 10) << before << " kB → " << after << " kB";
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float want = i >= lo && i < hi ? 0.0f : static_cast<float>(i % 1000) + 1.0f;
    wrong += buf[i] != want;
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(buf.released_pages(), n / page - 10);
  // zero() clears the rest and leaves the released pages out of residence.
  const int64_t before_zero = vm_rss_kb();
  buf.zero();
  EXPECT_LT(vm_rss_kb(), before_zero + 1024);
  EXPECT_EQ(buf.released_pages(), 0);
  wrong = 0;
  for (int64_t i = 0; i < n; i += 7) wrong += buf[i] != 0.0f;
  EXPECT_EQ(wrong, 0);
  // A released page written again holds what was written.
  buf[lo + page] = 2.5f;
  EXPECT_EQ(buf[lo + page], 2.5f);
}

TEST(PageBuffer, SmallRangesAreZeroedInPlace) {
  const int64_t page = static_cast<int64_t>(PageBuffer::page_bytes() / sizeof(float));
  PageBuffer buf(3 * page);
  buf.zero();
  for (int64_t i = 0; i < 3 * page; ++i) buf[i] = 1.0f;
  EXPECT_EQ(buf.clear(10, page - 20), 0);  // inside one page
  EXPECT_EQ(buf.released_pages(), 0);
  for (int64_t i = 0; i < 3 * page; ++i)
    ASSERT_EQ(buf[i], i >= 10 && i < page - 10 ? 0.0f : 1.0f) << i;
  EXPECT_THROW(buf.clear(2 * page, page + 1), Error);
}
