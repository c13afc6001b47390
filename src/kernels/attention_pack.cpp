// The f32 attention's head transposes (attention_rows.h: pack_transposed).
#include <algorithm>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/cpu.h"
#include "kernels/attention_rows.h"

namespace moetrain {

namespace {

// d[x·Tp + t] = s[t·lds + x] for t in [t0, T), x in [0, HS).
void transpose_rows(float* d, const float* s, int64_t t0, int64_t T, int64_t lds, int64_t HS,
                    int64_t Tp) {
  for (int64_t t = t0; t < T; ++t) {
    for (int64_t x = 0; x < HS; ++x) d[x * Tp + t] = s[t * lds + x];
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOETRAIN_ATTN_PACK_AVX2 1
// The same copy in 8 × 8 blocks transposed in registers (eight row loads, eight column stores),
// the rest element by element. Moves only: the same values.
__attribute__((target("avx2"))) void transpose_rows_avx2(float* d, const float* s, int64_t T,
                                                         int64_t lds, int64_t HS, int64_t Tp) {
  const int64_t T8 = T / 8 * 8, X8 = HS / 8 * 8;
  for (int64_t t = 0; t < T8; t += 8) {
    for (int64_t x = 0; x < X8; x += 8) {
      __m256 r[8], u[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + (t + i) * lds + x);
      for (int i = 0; i < 8; i += 2) {
        u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(u[i], u[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(d + (x + i) * Tp + t, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(d + (x + i + 4) * Tp + t, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
    for (int64_t x = X8; x < HS; ++x) {
      for (int64_t i = 0; i < 8; ++i) d[x * Tp + t + i] = s[(t + i) * lds + x];
    }
  }
  transpose_rows(d, s, T8, T, lds, HS, Tp);
}
#endif

}  // namespace

void pack_transposed(float* dst, const float* src, int64_t B, int64_t T, int64_t H, int64_t HS,
                     int64_t Tp) {
  [[maybe_unused]] const bool avx2 = cpu_has_avx2();
#pragma omp parallel for collapse(2) schedule(static) if (B * T * H * HS >= kParallelMinCopy)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      float* d = dst + (b * H + h) * HS * Tp;
      const float* s = src + (b * T * H + h) * HS;
#ifdef MOETRAIN_ATTN_PACK_AVX2
      if (avx2) {
        transpose_rows_avx2(d, s, T, H * HS, HS, Tp);
      } else
#endif
      {
        transpose_rows(d, s, 0, T, H * HS, HS, Tp);
      }
      for (int64_t x = 0; x < HS; ++x) std::fill(d + x * Tp + T, d + (x + 1) * Tp, 0.0f);
    }
  }
}

}  // namespace moetrain
