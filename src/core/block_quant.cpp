#include "core/block_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/cpu.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define MOETRAIN_QUANT_X86 1
#endif

namespace moetrain {

namespace {

// max |x|, or NaN when x holds a NaN or an Inf.
float amax_scalar(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (!(a <= std::numeric_limits<float>::max())) return std::numeric_limits<float>::quiet_NaN();
    m = std::max(m, a);
  }
  return m;
}

float scale_scalar(const float* x, int64_t n) {
  return amax_scalar(x, n) / 127.0f;
}

void codes_scalar(const float* v, int64_t len, float scale, int8_t* q, float* residual) {
  for (int64_t i = 0; i < len; ++i) {
    // An all-zero block, or a NaN scale (the scale carries it): code 0, no residual.
    const float r = scale > 0.0f ? std::nearbyint(v[i] / scale) : 0.0f;
    const auto qi = static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
    q[i] = qi;
    if (residual) residual[i] = std::isnan(scale) ? 0.0f : v[i] - static_cast<float>(qi) * scale;
  }
}

#ifdef MOETRAIN_QUANT_X86
// No FMA in the target: v − q·scale must round twice, as the scalar path does.
__attribute__((target("avx2"))) float scale_avx2(const float* v, int64_t len) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 fmax = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(v + i), abs_mask);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, fmax, _CMP_NLE_UQ));  // Inf or NaN
    m = _mm256_max_ps(a, m);
  }
  if (_mm256_movemask_ps(bad) != 0) return std::numeric_limits<float>::quiet_NaN();
  float amax = amax_scalar(v + i, len - i);  // NaN when the tail is not finite
  if (std::isnan(amax)) return amax;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float x : lanes) amax = std::max(amax, x);
  return amax / 127.0f;
}

__attribute__((target("avx2"))) void codes_avx2(const float* v, int64_t len, float scale,
                                                int8_t* q, float* residual) {
  if (!(scale > 0.0f)) {
    codes_scalar(v, len, scale, q, residual);
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
  codes_scalar(v + i, len - i, scale, q + i, residual ? residual + i : nullptr);
}

#endif

// Quantises x[0, n) into wire; with a residual, x + residual and the residual becomes what
// quantising lost.
void quantise(uint8_t* wire, const float* x, float* residual, int64_t n) {
  const bool vec = quant_vector_path_available();
  const int64_t nb = quant_blocks(n);
  int8_t* codes = reinterpret_cast<int8_t*>(wire + nb * 4);
  alignas(32) float v[kQuantBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kQuantBlock, len = std::min(kQuantBlock, n - lo);
    const float* in = x + lo;
    if (residual) {
      for (int64_t i = 0; i < len; ++i) v[i] = x[lo + i] + residual[lo + i];
      in = v;
    }
    const float scale = quant_block_scale(in, len, vec);
    std::memcpy(wire + b * 4, &scale, 4);
    quant_block_codes(in, len, scale, codes + lo, residual ? residual + lo : nullptr, vec);
  }
}

}  // namespace

bool quant_vector_path_available() {
#ifdef MOETRAIN_QUANT_X86
  return cpu_has_avx2();
#else
  return false;
#endif
}

float quant_block_scale(const float* v, int64_t len, bool vector_path) {
#ifdef MOETRAIN_QUANT_X86
  if (vector_path && cpu_has_avx2()) return scale_avx2(v, len);
#endif
  (void)vector_path;
  return scale_scalar(v, len);
}

void quant_block_codes(const float* v, int64_t len, float scale, int8_t* q, float* residual,
                       bool vector_path) {
#ifdef MOETRAIN_QUANT_X86
  if (vector_path && cpu_has_avx2()) return codes_avx2(v, len, scale, q, residual);
#endif
  (void)vector_path;
  codes_scalar(v, len, scale, q, residual);
}

void quantise_int8(uint8_t* wire, const float* x, int64_t n) {
  quantise(wire, x, nullptr, n);
}

void quantise_int8_feedback(uint8_t* wire, const float* x, float* residual, int64_t n) {
  quantise(wire, x, residual, n);
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

}  // namespace moetrain
