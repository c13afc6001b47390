// f32 → bf16 on the device, bit for bit core/dtype.h's bf16(float): round to nearest, ties to
// even, NaN kept NaN with its quiet bit set.
#pragma once
#include <cstdint>

namespace moetrain::cuda {

__device__ __forceinline__ uint16_t bf16_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace moetrain::cuda
