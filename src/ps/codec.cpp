#include "ps/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/dtype.h"

namespace moetrain::ps {

Encoding parse_compression(std::string_view name) {
  if (name == "none") return Encoding::F32;
  if (name == "bf16") return Encoding::Bf16;
  if (name == "int8") return Encoding::Int8;
  MOETRAIN_FAIL("push compression '{}': allowed are none, bf16, int8", name);
}

std::string_view compression_name(Encoding e) {
  switch (e) {
    case Encoding::F32: return "none";
    case Encoding::Bf16: return "bf16";
    case Encoding::Int8: return "int8";
    case Encoding::Json: return "json";
  }
  return "unknown";
}

std::size_t encoded_size(Encoding e, int64_t n) {
  const auto un = static_cast<std::size_t>(n);
  switch (e) {
    case Encoding::F32: return un * 4;
    case Encoding::Bf16: return un * 2;
    case Encoding::Int8: {
      const std::size_t blocks = (un + kInt8Block - 1) / kInt8Block;
      return blocks * 4 + un;
    }
    case Encoding::Json: break;
  }
  MOETRAIN_FAIL("encoding {} does not carry float values", static_cast<uint32_t>(e));
}

void append_values(Encoding e, const float* values, int64_t n, float* residual, std::string& out) {
  const std::size_t at = out.size();
  out.resize(at + encoded_size(e, n));
  char* dst = out.data() + at;
  if (e == Encoding::F32) {
    std::memcpy(dst, values, static_cast<std::size_t>(n) * 4);
  } else if (e == Encoding::Bf16) {
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t b = bf16(values[i]).bits;
      std::memcpy(dst + 2 * i, &b, 2);
    }
  } else {
    // Per block: the f32 scale, then the block's int8 values.
    for (int64_t b0 = 0; b0 < n; b0 += kInt8Block) {
      const int64_t len = std::min(kInt8Block, n - b0);
      float v[kInt8Block];
      float amax = 0;
      for (int64_t i = 0; i < len; ++i) {
        v[i] = values[b0 + i] + (residual ? residual[b0 + i] : 0.0f);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float scale = amax > 0 ? amax / 127.0f : 0.0f;
      std::memcpy(dst, &scale, 4);
      dst += 4;
      for (int64_t i = 0; i < len; ++i) {
        const float q = scale > 0 ? std::nearbyint(v[i] / scale) : 0.0f;
        const auto qi = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
        dst[i] = static_cast<char>(qi);
        if (residual) residual[b0 + i] = v[i] - static_cast<float>(qi) * scale;
      }
      dst += len;
    }
  }
}

void decode_values(Encoding e, const char* data, std::size_t bytes, int64_t n, float* dst) {
  MOETRAIN_CHECK(bytes == encoded_size(e, n), "{} values in {} take {} bytes, the message has {}",
                 n, compression_name(e), encoded_size(e, n), bytes);
  if (e == Encoding::F32) {
    std::memcpy(dst, data, bytes);
  } else if (e == Encoding::Bf16) {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, data + 2 * i, 2);
      dst[i] = static_cast<float>(bf16::from_bits(b));
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

std::string encode_push(Encoding e, const float* values, int64_t n,
                        const std::vector<Span>* ranges, float* residual) {
  std::string out;
  if (!ranges) {
    append_values(e, values, n, residual, out);
    return out;
  }
  const auto count = static_cast<uint32_t>(ranges->size());
  out.append(reinterpret_cast<const char*>(&count), 4);
  int64_t total = 0;
  for (const Span& s : *ranges) {
    out.append(reinterpret_cast<const char*>(&s.offset), 8);
    out.append(reinterpret_cast<const char*>(&s.size), 8);
    total += s.size;
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
  append_values(e, packed.data(), total, residual ? res.data() : nullptr, out);
  if (residual) {
    at = 0;
    for (const Span& s : *ranges) {
      std::copy_n(res.begin() + at, s.size, residual + s.offset);
      at += s.size;
    }
  }
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
