#include "parallel/block_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace moetrain {

namespace {

float block_scale(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (!(a <= std::numeric_limits<float>::max())) return std::numeric_limits<float>::quiet_NaN();
    m = std::max(m, a);
  }
  return m / 127.0f;
}

int8_t code(float x, float scale) {
  if (!(scale > 0.0f)) return 0;  // an all-zero block, or a NaN scale (the scale carries it)
  const float q = std::nearbyint(x / scale);
  return static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
}

}  // namespace

void quantise_int8(uint8_t* wire, const float* x, int64_t n) {
  const int64_t nb = quant_blocks(n);
  int8_t* codes = reinterpret_cast<int8_t*>(wire + nb * 4);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kQuantBlock, len = std::min(kQuantBlock, n - lo);
    const float scale = block_scale(x + lo, len);
    std::memcpy(wire + b * 4, &scale, 4);
    for (int64_t i = 0; i < len; ++i) codes[lo + i] = code(x[lo + i], scale);
  }
}

void dequantise_int8(float* x, const uint8_t* wire, int64_t n) {
  std::fill_n(x, n, 0.0f);
  accumulate_int8(x, wire, n);
}

void accumulate_int8(float* x, const uint8_t* wire, int64_t n) {
  const int64_t nb = quant_blocks(n);
  const int8_t* codes = reinterpret_cast<const int8_t*>(wire + nb * 4);
  for (int64_t b = 0; b < nb; ++b) {
    float scale;
    std::memcpy(&scale, wire + b * 4, 4);
    const int64_t lo = b * kQuantBlock, hi = std::min(n, lo + kQuantBlock);
    for (int64_t i = lo; i < hi; ++i) x[i] += static_cast<float>(codes[i]) * scale;
  }
}

void quantise_int8_feedback(uint8_t* wire, const float* x, float* residual, int64_t n) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = x[i] + residual[i];
  quantise_int8(wire, v.data(), n);
  const int64_t nb = quant_blocks(n);
  const int8_t* codes = reinterpret_cast<const int8_t*>(wire + nb * 4);
  for (int64_t b = 0; b < nb; ++b) {
    float scale;
    std::memcpy(&scale, wire + b * 4, 4);
    const int64_t lo = b * kQuantBlock, hi = std::min(n, lo + kQuantBlock);
    for (int64_t i = lo; i < hi; ++i)
      residual[i] = std::isnan(scale) ? 0.0f : v[i] - static_cast<float>(codes[i]) * scale;
  }
}

}  // namespace moetrain
