// Element types: f32, bf16 (bfloat16: the top 16 bits of an IEEE f32) and fp16 (IEEE binary16).
// bf16 and fp16 are the low-precision GEMM operand types of mixed-precision training; both
// convert from f32 by round to nearest, ties to even, and widen to f32 exactly.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <string_view>

namespace moetrain {

enum class DType { F32, BF16, F16 };

// The operands of a GPU's matrix products (train.precision with train.device = cuda): true f32;
// TF32 (f32 storage, the tensor cores round the operands to 10-bit significands); bf16 (operands
// rounded as DType::BF16 rounds them on the CPU). Accumulation is f32 in all three.
enum class DeviceGemm { F32, TF32, BF16 };

constexpr std::size_t dtype_size(DType t) {
  return t == DType::F32 ? 4 : 2;
}
// "f32", "bf16", "fp16": the names configs and flags use.
constexpr std::string_view dtype_name(DType t) {
  return t == DType::F32 ? "f32" : t == DType::BF16 ? "bf16" : "fp16";
}
// Parses a dtype name among `allowed` (a subset of f32, bf16, fp16); an Error names `key`, the
// value and the allowed names.
DType parse_dtype(std::string_view name, std::string_view key,
                  std::initializer_list<DType> allowed = {DType::F32, DType::BF16, DType::F16});

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
  // Written as a select, so that loops converting arrays (the optimizer's) vectorise.
  explicit bf16(float f) : bits(round_bits(f)) {}
  static uint16_t round_bits(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    const uint32_t nan = (u >> 16) | 0x0040u;
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
  explicit operator float() const {
    return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
  }
  float to_float() const { return static_cast<float>(*this); }
};
static_assert(sizeof(bf16) == 2);

// IEEE 754 binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits. Largest finite 65504,
// smallest normal 2^-14, smallest subnormal 2^-24.
struct fp16 {
  uint16_t bits = 0;

  fp16() = default;
  static constexpr fp16 from_bits(uint16_t b) {
    fp16 v;
    v.bits = b;
    return v;
  }
  // Round to nearest, ties to even, with gradual underflow; |f| ≥ 65520 (halfway past 65504,
  // which has an odd mantissa) becomes Inf; NaN stays NaN with the quiet bit set.
  explicit fp16(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {
      bits = static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    } else if (a >= 0x477ff000u) {
      bits = static_cast<uint16_t>(sign | 0x7c00u);
    } else if (a < 0x38800000u) {
      // Below 2^-14: adding 0.5 puts the binary point so that the f32 adder rounds |f| to a
      // multiple of 2^-24 (ties to even), which the low mantissa bits then hold.
      const float r = std::bit_cast<float>(a) + 0.5f;
      bits = static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(r) - 0x3f000000u));
    } else {
      // Rebias the exponent (127 → 15) and round the 13 dropped bits to nearest even.
      a += 0xc8000fffu + ((a >> 13) & 1u);
      bits = static_cast<uint16_t>(sign | (a >> 13));
    }
  }
  explicit operator float() const {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    const uint32_t e = (bits >> 10) & 0x1fu, m = bits & 0x3ffu;
    if (e == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
      const float v = static_cast<float>(m) * 0x1p-24f;
      return sign ? -v : v;
    }
    return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
  }
  float to_float() const { return static_cast<float>(*this); }
};
static_assert(sizeof(fp16) == 2);

inline float bf16_round(float f) {
  return bf16(f).to_float();
}
inline float fp16_round(float f) {
  return fp16(f).to_float();
}
// f rounded to dtype t and widened back (f itself for F32).
inline float round_to(DType t, float f) {
  return t == DType::BF16 ? bf16_round(f) : t == DType::F16 ? fp16_round(f) : f;
}

// out[i] = bf16(in[i]) on the calling thread, with AVX512_BF16 where the CPU has it (the same
// bits either way: core/bf16_round.h).
void round_to_bf16(bf16* out, const float* in, int64_t n);

// Bulk conversions (OpenMP parallel for large n).
void f32_to_bf16(bf16* out, const float* in, std::size_t n);
void bf16_to_f32(float* out, const bf16* in, std::size_t n);
void f32_to_fp16(fp16* out, const float* in, std::size_t n);
void fp16_to_f32(float* out, const fp16* in, std::size_t n);
// The same chosen at run time: out holds n elements of t (bf16 or fp16; F32 copies).
void f32_to_dtype(DType t, void* out, const float* in, std::size_t n);
void dtype_to_f32(DType t, float* out, const void* in, std::size_t n);

// The low-precision copy of the parameters a mixed-precision model computes with (bf16 or fp16;
// element i is parameter i), which an optimizer step can write as it updates (optim/optimizer.h):
// each updated element rounded in the same pass, instead of a second pass over the whole buffer.
// No data: no copy to keep.
struct LowPrecisionCopy {
  DType type = DType::F32;
  void* data = nullptr;
  // The copy from element `offset` on.
  LowPrecisionCopy at(int64_t offset) const {
    if (!data) return {};
    return {type, static_cast<char*>(data) + offset * static_cast<int64_t>(dtype_size(type))};
  }
};

}  // namespace moetrain
