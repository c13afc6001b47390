#include "optim/clip.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/check.h"

namespace moetrain {

namespace {

constexpr int64_t kParallelMin = 1 << 14;
constexpr int kLanes = 8;

// g (n ≤ kSumBlock): element i goes to accumulator i % 8, so the rounding pattern is fixed.
double block_sum_squares(const float* g, int64_t n) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const double x = g[i + j];
      acc[j] += x * x;
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const double x = g[i];
    acc[j] += x * x;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

}  // namespace

double grad_sum_squares(const float* g, int64_t n) {
  MOETRAIN_CHECK(n >= 0, "grad_sum_squares: n = {} must be >= 0", n);
  MOETRAIN_CHECK(n == 0 || g != nullptr, "grad_sum_squares: null gradient of {} elements", n);
  const int64_t blocks = (n + kSumBlock - 1) / kSumBlock;
  std::vector<double> partial(blocks);
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kSumBlock;
    partial[b] = block_sum_squares(g + lo, std::min(kSumBlock, n - lo));
  }
  double sum = 0.0;
  for (double p : partial) sum += p;
  return sum;
}

double grad_norm(const float* g, int64_t n) {
  return std::sqrt(grad_sum_squares(g, n));
}

double clip_coefficient(double norm, double max_norm) {
  MOETRAIN_CHECK(std::isfinite(max_norm) && max_norm > 0.0,
                 "clip: max_norm = {} must be finite and > 0", max_norm);
  if (!std::isfinite(norm) || norm <= max_norm) return 1.0;
  return max_norm / (norm + 1e-6);
}

void scale_gradients(float* g, int64_t n, float scale) {
  MOETRAIN_CHECK(n >= 0, "scale_gradients: n = {} must be >= 0", n);
  MOETRAIN_CHECK(n == 0 || g != nullptr, "scale_gradients: null gradient of {} elements", n);
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) g[i] *= scale;
}

double clip_grad_norm(float* g, int64_t n, double max_norm) {
  const double norm = grad_norm(g, n);
  const double coef = clip_coefficient(norm, max_norm);
  if (coef != 1.0) scale_gradients(g, n, static_cast<float>(coef));
  return norm;
}

bool has_non_finite(const float* g, int64_t n) {
  MOETRAIN_CHECK(n >= 0, "has_non_finite: n = {} must be >= 0", n);
  MOETRAIN_CHECK(n == 0 || g != nullptr, "has_non_finite: null gradient of {} elements", n);
  // An all-ones exponent is exactly NaN or ±Inf; the bit test vectorises where isfinite may not.
  int bad = 0;
#pragma omp parallel for simd schedule(static) reduction(| : bad) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, g + i, sizeof(bits));
    bad |= (bits & 0x7f800000u) == 0x7f800000u;
  }
  return bad != 0;
}

}  // namespace moetrain
