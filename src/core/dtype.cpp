#include "core/dtype.h"

namespace moetrain {

void f32_to_bf16(bf16* out, const float* in, std::size_t n) {
  const std::ptrdiff_t sn = static_cast<std::ptrdiff_t>(n);
#pragma omp parallel for schedule(static) if (sn > (1 << 16))
  for (std::ptrdiff_t i = 0; i < sn; ++i) out[i] = bf16(in[i]);
}

void bf16_to_f32(float* out, const bf16* in, std::size_t n) {
  const std::ptrdiff_t sn = static_cast<std::ptrdiff_t>(n);
#pragma omp parallel for schedule(static) if (sn > (1 << 16))
  for (std::ptrdiff_t i = 0; i < sn; ++i) out[i] = in[i].to_float();
}

}  // namespace moetrain
