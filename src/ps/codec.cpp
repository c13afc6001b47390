#include "ps/codec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/check.h"
#include "core/dtype.h"
#include "core/block_quant.h"

namespace moetrain::ps {

Encoding parse_compression(std::string_view name, std::string_view option) {
  if (name == "none") return Encoding::F32;
  if (name == "bf16") return Encoding::Bf16;
  if (name == "int8") return Encoding::Int8;
  MOETRAIN_FAIL("{} '{}': allowed are none, bf16, int8", option, name);
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
    case Encoding::Int8:
      return static_cast<std::size_t>(quant_wire_bytes(n));
    case Encoding::Json:
      break;
  }
  MOETRAIN_FAIL("encoding {} does not carry float values", static_cast<uint32_t>(e));
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
  } else if (residual) {
    quantise_int8_feedback(reinterpret_cast<uint8_t*>(dst), values, residual, n);
  } else {
    quantise_int8(reinterpret_cast<uint8_t*>(dst), values, n);
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
    dequantise_int8(dst, reinterpret_cast<const uint8_t*>(data), n);
  }
}

std::size_t ranges_size(const std::vector<Span>& ranges) { return 4 + 16 * ranges.size(); }

void write_ranges(const std::vector<Span>& ranges, char* out) {
  const auto count = static_cast<uint32_t>(ranges.size());
  std::memcpy(out, &count, 4);
  out += 4;
  for (const Span& s : ranges) {
    std::memcpy(out, &s.offset, 8);
    std::memcpy(out + 8, &s.size, 8);
    out += 16;
  }
}

std::size_t read_ranges(const char* payload, std::size_t bytes, int64_t n, std::vector<Span>& out) {
  out.clear();
  MOETRAIN_CHECK(bytes >= 4, "a sparse payload of {} bytes has no range count", bytes);
  uint32_t count;
  std::memcpy(&count, payload, 4);
  MOETRAIN_CHECK(count <= static_cast<uint64_t>(n) && 4 + uint64_t{count} * 16 <= bytes,
                 "a sparse payload declares {} ranges, more than its {} bytes or {} keys hold",
                 count, bytes, n);
  int64_t end = 0;
  for (uint32_t i = 0; i < count; ++i) {
    Span s;
    std::memcpy(&s.offset, payload + 4 + 16 * i, 8);
    std::memcpy(&s.size, payload + 12 + 16 * i, 8);
    MOETRAIN_CHECK(s.offset >= end && s.size >= 0 && s.size <= n - s.offset,
                   "sparse range {} = [{}, +{}) is outside [0, {}) or out of order", i, s.offset,
                   s.size, n);
    end = s.offset + s.size;
    out.push_back(s);
  }
  return 4 + std::size_t{count} * 16;
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
  write_ranges(*ranges, out);
  out += ranges_size(*ranges);
  int64_t total = 0;
  for (const Span& s : *ranges) total += s.size;
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
                 std::vector<Span>* ranges, bool zero_rest) {
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
  const std::size_t head = read_ranges(payload, h.bytes, n, rs);
  int64_t total = 0;
  for (const Span& s : rs) total += s.size;
  std::vector<float> packed(static_cast<std::size_t>(total));
  decode_values(e, payload + head, h.bytes - head, total, packed.data());
  if (zero_rest) std::fill(dst, dst + n, 0.0f);
  int64_t at = 0;
  for (const Span& s : rs) {
    std::copy_n(packed.begin() + at, s.size, dst + s.offset);
    at += s.size;
  }
}

}  // namespace moetrain::ps
