#include "ps/codec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/check.h"
#include "core/dtype.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define MOETRAIN_PS_X86 1
#endif

namespace moetrain::ps {

Encoding parse_compression(std::string_view name) {
  if (name == "none") return Encoding::F32;
  if (name == "bf16") return Encoding::Bf16;
  if (name == "int8") return Encoding::Int8;
  MOETRAIN_FAIL("push compression '{}': allowed are none, bf16, int8", name);
}

std::string_view compression_name(Encoding e) {
  switch (e) {
    case Encoding::F32:
      return "none";
    case Encoding::Bf16:
      return "bf16";
    case Encoding::Int8:
      return "int8";
    case Encoding::Json:
      return "json";
  }
  return "unknown";
}

std::size_t encoded_size(Encoding e, int64_t n) {
  const auto un = static_cast<std::size_t>(n);
  switch (e) {
    case Encoding::F32:
      return un * 4;
    case Encoding::Bf16:
      return un * 2;
    case Encoding::Int8: {
      const std::size_t blocks = (un + kInt8Block - 1) / kInt8Block;
      return blocks * 4 + un;
    }
    case Encoding::Json:
      break;
  }
  MOETRAIN_FAIL("encoding {} does not carry float values", static_cast<uint32_t>(e));
}

namespace {

float amax_scalar(const float* v, int64_t len) {
  float amax = 0;
  for (int64_t i = 0; i < len; ++i) amax = std::max(amax, std::fabs(v[i]));
  return amax;
}

void quantize_scalar(const float* v, int64_t len, float scale, int8_t* q, float* residual) {
  for (int64_t i = 0; i < len; ++i) {
    const float r = scale > 0 ? std::nearbyint(v[i] / scale) : 0.0f;
    const auto qi = static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
    q[i] = qi;
    if (residual) residual[i] = v[i] - static_cast<float>(qi) * scale;
  }
}

#ifdef MOETRAIN_PS_X86
// No FMA in the target: v − q·scale must round twice, as the scalar path does.
__attribute__((target("avx2"))) float amax_avx2(const float* v, int64_t len) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  int64_t i = 0;
  // max(|v|, m) returns m when |v| is NaN: NaN is skipped, as std::max(amax, NaN) does.
  for (; i + 8 <= len; i += 8)
    m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), abs_mask), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0;
  for (float x : lanes) amax = std::max(amax, x);
  return std::max(amax, amax_scalar(v + i, len - i));
}

__attribute__((target("avx2"))) void quantize_avx2(const float* v, int64_t len, float scale,
                                                   int8_t* q, float* residual) {
  if (!(scale > 0)) {
    quantize_scalar(v, len, scale, q, residual);
    return;
  }
  const __m256 s = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    __m256 r = _mm256_round_ps(_mm256_div_ps(x, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
    const __m256i r32 = _mm256_cvtps_epi32(r);
    const __m128i r16 =
        _mm_packs_epi32(_mm256_castsi256_si128(r32), _mm256_extracti128_si256(r32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(r16, r16));
    // Through the integer, as the scalar path: −0 comes back as +0.
    if (residual)
      _mm256_storeu_ps(residual + i, _mm256_sub_ps(x, _mm256_mul_ps(_mm256_cvtepi32_ps(r32), s)));
  }
  quantize_scalar(v + i, len - i, scale, q + i, residual ? residual + i : nullptr);
}

const bool kAvx2 = __builtin_cpu_supports("avx2");
#endif

}  // namespace

bool int8_vector_path_available() {
#ifdef MOETRAIN_PS_X86
  return kAvx2;
#else
  return false;
#endif
}

float int8_block_amax(const float* v, int64_t len, bool vector_path) {
#ifdef MOETRAIN_PS_X86
  if (vector_path && kAvx2) return amax_avx2(v, len);
#endif
  (void)vector_path;
  return amax_scalar(v, len);
}

void int8_block_quantize(const float* v, int64_t len, float scale, int8_t* q, float* residual,
                         bool vector_path) {
#ifdef MOETRAIN_PS_X86
  if (vector_path && kAvx2) return quantize_avx2(v, len, scale, q, residual);
#endif
  (void)vector_path;
  quantize_scalar(v, len, scale, q, residual);
}

void write_values(Encoding e, const float* values, int64_t n, float* residual, char* dst) {
  if (e == Encoding::F32) {
    std::memcpy(dst, values, static_cast<std::size_t>(n) * 4);
  } else if (e == Encoding::Bf16) {
    // Frames place bf16 values at even offsets; the bulk conversion (core/dtype) needs that.
    if (reinterpret_cast<std::uintptr_t>(dst) % alignof(bf16) == 0) {
      f32_to_bf16(reinterpret_cast<bf16*>(dst), values, static_cast<std::size_t>(n));
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t b = bf16(values[i]).bits;
        std::memcpy(dst + 2 * i, &b, 2);
      }
    }
  } else {
    // Per block: the f32 scale, then the block's int8 values.
    const bool vec = int8_vector_path_available();
    for (int64_t b0 = 0; b0 < n; b0 += kInt8Block) {
      const int64_t len = std::min(kInt8Block, n - b0);
      alignas(32) float v[kInt8Block];
      if (residual) {
        for (int64_t i = 0; i < len; ++i) v[i] = values[b0 + i] + residual[b0 + i];
      } else {
        std::memcpy(v, values + b0, static_cast<std::size_t>(len) * 4);
      }
      const float amax = int8_block_amax(v, len, vec);
      const float scale = amax > 0 ? amax / 127.0f : 0.0f;
      std::memcpy(dst, &scale, 4);
      int8_block_quantize(v, len, scale, reinterpret_cast<int8_t*>(dst + 4),
                          residual ? residual + b0 : nullptr, vec);
      dst += 4 + len;
    }
  }
}

void append_values(Encoding e, const float* values, int64_t n, float* residual, std::string& out) {
  const std::size_t at = out.size();
  out.resize(at + encoded_size(e, n));
  write_values(e, values, n, residual, out.data() + at);
}

void decode_values(Encoding e, const char* data, std::size_t bytes, int64_t n, float* dst) {
  MOETRAIN_CHECK(bytes == encoded_size(e, n), "{} values in {} take {} bytes, the message has {}",
                 n, compression_name(e), encoded_size(e, n), bytes);
  if (e == Encoding::F32) {
    std::memcpy(dst, data, bytes);
  } else if (e == Encoding::Bf16) {
    if (reinterpret_cast<std::uintptr_t>(data) % alignof(bf16) == 0) {
      bf16_to_f32(dst, reinterpret_cast<const bf16*>(data), static_cast<std::size_t>(n));
    } else {
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, data + 2 * i, 2);
        dst[i] = static_cast<float>(bf16::from_bits(b));
      }
    }
  } else {
    for (int64_t b0 = 0; b0 < n; b0 += kInt8Block) {
      const int64_t len = std::min(kInt8Block, n - b0);
      float scale;
      std::memcpy(&scale, data, 4);
      data += 4;
      for (int64_t i = 0; i < len; ++i)
        dst[b0 + i] = static_cast<float>(static_cast<int8_t>(data[i])) * scale;
      data += len;
    }
  }
}

std::size_t push_payload_size(Encoding e, int64_t n, const std::vector<Span>* ranges) {
  if (!ranges) return encoded_size(e, n);
  int64_t total = 0;
  for (const Span& s : *ranges) total += s.size;
  return 4 + 16 * ranges->size() + encoded_size(e, total);
}

void write_push(Encoding e, const float* values, int64_t n, const std::vector<Span>* ranges,
                float* residual, char* out) {
  if (!ranges) {
    write_values(e, values, n, residual, out);
    return;
  }
  const auto count = static_cast<uint32_t>(ranges->size());
  std::memcpy(out, &count, 4);
  out += 4;
  int64_t total = 0;
  for (const Span& s : *ranges) {
    std::memcpy(out, &s.offset, 8);
    std::memcpy(out + 8, &s.size, 8);
    out += 16;
    total += s.size;
  }
  if (e != Encoding::Int8) {
    // Element-wise encodings: each range straight into the frame.
    for (const Span& s : *ranges) {
      write_values(e, values + s.offset, s.size, nullptr, out);
      out += encoded_size(e, s.size);
    }
    return;
  }
  // One value stream for all ranges: int8 blocks span range boundaries, which keeps the scale
  // overhead independent of how fragmented the ranges are.
  std::vector<float> packed(static_cast<std::size_t>(total)), res(residual ? packed.size() : 0);
  int64_t at = 0;
  for (const Span& s : *ranges) {
    std::copy_n(values + s.offset, s.size, packed.begin() + at);
    if (residual) std::copy_n(residual + s.offset, s.size, res.begin() + at);
    at += s.size;
  }
  write_values(e, packed.data(), total, residual ? res.data() : nullptr, out);
  if (residual) {
    at = 0;
    for (const Span& s : *ranges) {
      std::copy_n(res.begin() + at, s.size, residual + s.offset);
      at += s.size;
    }
  }
}

std::string encode_push(Encoding e, const float* values, int64_t n, const std::vector<Span>* ranges,
                        float* residual) {
  std::string out(push_payload_size(e, n, ranges), '\0');
  write_push(e, values, n, ranges, residual, out.data());
  return out;
}

void decode_push(const Header& h, const char* payload, int64_t n, float* dst,
                 std::vector<Span>* ranges) {
  const Encoding e = h.encoding();
  MOETRAIN_CHECK(e != Encoding::Json, "a push must carry values, not JSON");
  std::vector<Span> local;
  std::vector<Span>& rs = ranges ? *ranges : local;
  rs.clear();
  if (!(h.flags & kSparseFlag)) {
    decode_values(e, payload, h.bytes, n, dst);
    rs.push_back({0, n});
    return;
  }
  MOETRAIN_CHECK(h.bytes >= 4, "sparse push of {} bytes has no range count", h.bytes);
  uint32_t count;
  std::memcpy(&count, payload, 4);
  MOETRAIN_CHECK(count <= static_cast<uint64_t>(n) && 4 + uint64_t{count} * 16 <= h.bytes,
                 "sparse push declares {} ranges, more than its {} bytes or {} keys hold", count,
                 h.bytes, n);
  int64_t total = 0, end = 0;
  for (uint32_t i = 0; i < count; ++i) {
    Span s;
    std::memcpy(&s.offset, payload + 4 + 16 * i, 8);
    std::memcpy(&s.size, payload + 12 + 16 * i, 8);
    MOETRAIN_CHECK(s.offset >= end && s.size >= 0 && s.size <= n - s.offset,
                   "sparse push range {} = [{}, +{}) is outside [0, {}) or out of order", i,
                   s.offset, s.size, n);
    end = s.offset + s.size;
    total += s.size;
    rs.push_back(s);
  }
  std::vector<float> packed(static_cast<std::size_t>(total));
  const std::size_t head = 4 + std::size_t{count} * 16;
  decode_values(e, payload + head, h.bytes - head, total, packed.data());
  std::fill(dst, dst + n, 0.0f);
  int64_t at = 0;
  for (const Span& s : rs) {
    std::copy_n(packed.begin() + at, s.size, dst + s.offset);
    at += s.size;
  }
}

}  // namespace moetrain::ps
