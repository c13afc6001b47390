// Element types: f32 and bf16 (bfloat16: the top 16 bits of an IEEE f32).
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moetrain {

enum class DType { F32, BF16 };

constexpr std::size_t dtype_size(DType t) {
  return t == DType::F32 ? 4 : 2;
}
constexpr std::string_view dtype_name(DType t) {
  return t == DType::F32 ? "f32" : "bf16";
}

struct bf16 {
  uint16_t bits = 0;

  bf16() = default;
  static constexpr bf16 from_bits(uint16_t b) {
    bf16 v;
    v.bits = b;
    return v;
  }
  // Round to nearest, ties to even. NaN stays NaN (quiet bit forced so that truncation
  // can never turn a NaN payload into Inf); Inf and subnormals convert exactly by the same rule.
  explicit bf16(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<uint16_t>((u >> 16) | 0x0040u);
      return;
    }
    uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    bits = static_cast<uint16_t>((u + rounding) >> 16);
  }
  explicit operator float() const {
    return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
  }
  float to_float() const { return static_cast<float>(*this); }
};
static_assert(sizeof(bf16) == 2);

inline float bf16_round(float f) {
  return bf16(f).to_float();
}

// Bulk conversions (OpenMP parallel for large n).
void f32_to_bf16(bf16* out, const float* in, std::size_t n);
void bf16_to_f32(float* out, const bf16* in, std::size_t n);

}  // namespace moetrain
