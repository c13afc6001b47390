#include "io/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define MOETRAIN_CRC32C_X86 1
#endif

namespace moetrain {

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // 0x1EDC6F41 bit-reversed

// tables[k][b]: the CRC of byte b followed by k zero bytes, for slice-by-8.
using Tables = std::array<std::array<uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
    t[0][b] = c;
  }
  for (uint32_t b = 0; b < 256; ++b)
    for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  return t;
}

constexpr Tables kTables = make_tables();

#ifdef MOETRAIN_CRC32C_X86
// The crc32 instruction has a latency of 3 cycles and a throughput of 1: one dependent chain
// runs at a third of its rate. Long inputs are therefore cut into runs of three blocks whose
// CRCs are computed side by side and then joined. CRC is linear: update(c, A ++ B) =
// shift(update(c, A), |B|) ^ update(0, B), where shift(c, n) = update(c, n zero bytes), itself
// linear in c, so a table per byte of c gives it (as zlib's crc32_combine, for one fixed n).
constexpr std::size_t kBlock = 8192;  // bytes per stream

__attribute__((target("sse4.2"))) uint32_t hw_chain(const uint8_t* p, std::size_t n, uint32_t c) {
  uint64_t c64 = c;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
  }
  c = static_cast<uint32_t>(c64);
  for (; n > 0; --n) c = _mm_crc32_u8(c, *p++);
  return c;
}

// shift_tables[k][b] = shift(b << 8k, kBlock).
using ShiftTables = std::array<std::array<uint32_t, 256>, 4>;

__attribute__((target("sse4.2"))) ShiftTables make_shift_tables() {
  static const std::array<uint8_t, kBlock> zeros{};
  ShiftTables t{};
  for (int k = 0; k < 4; ++k)
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = hw_chain(zeros.data(), kBlock, b << (8 * k));
  return t;
}

uint32_t shift_block(const ShiftTables& t, uint32_t c) {
  return t[0][c & 0xFFu] ^ t[1][(c >> 8) & 0xFFu] ^ t[2][(c >> 16) & 0xFFu] ^ t[3][c >> 24];
}

__attribute__((target("sse4.2"))) uint32_t hw_update(const uint8_t* p, std::size_t n, uint32_t c) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    c = _mm_crc32_u8(c, *p++);
    --n;
  }
  if (n >= 3 * kBlock) {
    static const ShiftTables shift = make_shift_tables();
    for (; n >= 3 * kBlock; p += 3 * kBlock, n -= 3 * kBlock) {
      uint64_t a = c, b = 0, d = 0;
      for (std::size_t i = 0; i < kBlock; i += 8) {
        uint64_t va, vb, vd;
        std::memcpy(&va, p + i, 8);
        std::memcpy(&vb, p + kBlock + i, 8);
        std::memcpy(&vd, p + 2 * kBlock + i, 8);
        a = _mm_crc32_u64(a, va);
        b = _mm_crc32_u64(b, vb);
        d = _mm_crc32_u64(d, vd);
      }
      c = shift_block(shift,
                      shift_block(shift, static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^
          static_cast<uint32_t>(d);
    }
  }
  return hw_chain(p, n, c);
}
#endif

bool detect_hardware() {
#ifdef MOETRAIN_CRC32C_X86
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

const bool kHardware = detect_hardware();

}  // namespace

uint32_t crc32c_table(const void* data, std::size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;  // little-endian: the first four bytes fold into the running CRC
    c = kTables[7][lo & 0xFFu] ^ kTables[6][(lo >> 8) & 0xFFu] ^ kTables[5][(lo >> 16) & 0xFFu] ^
        kTables[4][lo >> 24] ^ kTables[3][hi & 0xFFu] ^ kTables[2][(hi >> 8) & 0xFFu] ^
        kTables[1][(hi >> 16) & 0xFFu] ^ kTables[0][hi >> 24];
    p += 8, n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ kTables[0][(c ^ *p++) & 0xFFu];
  return ~c;
}

bool crc32c_hardware_available() {
  return kHardware;
}

uint32_t crc32c_hardware(const void* data, std::size_t n, uint32_t crc) {
#ifdef MOETRAIN_CRC32C_X86
  if (kHardware) return ~hw_update(static_cast<const uint8_t*>(data), n, ~crc);
#endif
  return crc32c_table(data, n, crc);
}

uint32_t crc32c(const void* data, std::size_t n, uint32_t crc) {
  return kHardware ? crc32c_hardware(data, n, crc) : crc32c_table(data, n, crc);
}

}  // namespace moetrain
