// Test support: naive double references and finite-difference gradient checks.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "core/rng.h"

namespace moetrain::testing {

inline std::vector<float> random_vector(int64_t n, uint64_t seed, float stddev = 1.0f) {
  std::vector<float> v(n);
  Rng rng(seed, rng_stream(RngPurpose::Test, 0, 0));
  rng_fill_normal(v.data(), n, rng, 0.0f, stddev);
  return v;
}

// Max |a - b| / (atol + rtol·|b|) over all elements must be ≤ 1; reports the worst index.
inline void expect_close(const float* a, const double* ref, int64_t n, double atol, double rtol,
                         const char* what = "") {
  double worst = 0;
  int64_t at = -1;
  for (int64_t i = 0; i < n; ++i) {
    double err = std::abs(double(a[i]) - ref[i]) / (atol + rtol * std::abs(ref[i]));
    if (!(err <= worst)) worst = err, at = i;  // NaN lands here too
  }
  EXPECT_LE(worst, 1.0) << what << ": worst element " << at << " got " << (at >= 0 ? a[at] : 0)
                        << " want " << (at >= 0 ? ref[at] : 0);
}

inline void expect_close(const float* a, const float* b, int64_t n, double atol, double rtol,
                         const char* what = "") {
  std::vector<double> ref(b, b + n);
  expect_close(a, ref.data(), n, atol, rtol, what);
}

// Central differences of a scalar loss in double-checked float: for each of up to `max_checks`
// entries of `param` (spread over it), compares (L(p+h) − L(p−h)) / 2h with `analytic`.
// `loss` must recompute the forward from scratch.
inline void check_gradient(float* param, const float* analytic, int64_t n,
                           const std::function<double()>& loss, const char* what, double h = 1e-2,
                           double atol = 2e-3, double rtol = 2e-2, int64_t max_checks = 64) {
  int64_t step = n <= max_checks ? 1 : n / max_checks;
  double worst = 0;
  int64_t at = -1;
  double worst_num = 0;
  for (int64_t i = 0; i < n; i += step) {
    float saved = param[i];
    param[i] = saved + static_cast<float>(h);
    double lp = loss();
    param[i] = saved - static_cast<float>(h);
    double lm = loss();
    param[i] = saved;
    double num = (lp - lm) / (2 * h);
    double err = std::abs(num - analytic[i]) / (atol + rtol * std::abs(num));
    if (!(err <= worst)) worst = err, at = i, worst_num = num;
  }
  EXPECT_LE(worst, 1.0) << what << ": element " << at << " analytic "
                        << (at >= 0 ? analytic[at] : 0) << " numeric " << worst_num;
}

}  // namespace moetrain::testing
