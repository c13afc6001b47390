#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/vec_math.h"

using namespace moetrain;

namespace {

// exp_vf8 over x into y, 8 at a time, compiled for whichever instruction set its caller is.
[[gnu::always_inline]] inline void exp_8_lanes(float* y, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    VF8 v;
    load_vf8(v, x + i);
    exp_vf8(v, v);
    store_vf8(y + i, v);
  }
  if (i < n) exp_tail(y + i, x + i, n - i);
}

// As a kernel built for baseline x86-64 runs it.
void exp_baseline(float* y, const float* x, int64_t n) {
  exp_8_lanes(y, x, n);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOETRAIN_TEST_AVX2 1
// The same, built for AVX2 with FMA available (what a kernel's AVX2 clone sees).
__attribute__((target("avx2,fma"))) void exp_avx2(float* y, const float* x, int64_t n) {
  exp_8_lanes(y, x, n);
}
// 16 lanes, built for AVX-512 (what SwiGLU's wide path runs).
__attribute__((target("avx512f"))) void exp_avx512(float* y, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    VF16 v;
    load_v(v, x + i);
    exp_v(v, v);
    store_v(y + i, v);
  }
  exp_baseline(y + i, x + i, n - i);
}
#endif

// Every float whose bit pattern is a multiple of `stride` apart, both signs.
std::vector<float> sweep(uint32_t stride) {
  std::vector<float> x;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += stride)
    x.push_back(std::bit_cast<float>(static_cast<uint32_t>(b)));
  return x;
}

// |y − e^x| in units of the last place of e^x (2^-149 below FLT_MIN).
double ulp_error(float x, float y) {
  const double ref = std::exp(static_cast<double>(x));
  if (ref < FLT_MIN) return std::fabs(y - ref) / 0x1p-149;
  int e;
  std::frexp(ref, &e);
  return std::fabs(static_cast<double>(y) - ref) / std::ldexp(1.0, e - 24);
}

}  // namespace

// The error bound stated in kernels/vec_math.h: less than 1 ulp of exp(x) (so at most 1 ulp from
// the correctly rounded float) where exp(x) is a normal float, within one subnormal step below
// that, +inf past FLT_MAX. A sweep over the whole float line, every 251st bit pattern.
TEST(VecMath, ExpWithinOneUlpOverTheFloatLine) {
  const std::vector<float> x = sweep(251);
  std::vector<float> y(x.size());
  exp_baseline(y.data(), x.data(), static_cast<int64_t>(x.size()));
  double worst_normal = 0, worst_subnormal = 0;
  int64_t checked = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) {
      ASSERT_TRUE(std::isnan(y[i])) << "exp(NaN) = " << y[i];
      continue;
    }
    const double ref = std::exp(static_cast<double>(x[i]));
    if (ref > FLT_MAX) {
      ASSERT_EQ(y[i], INFINITY) << "exp(" << x[i] << ") overflows";
      continue;
    }
    const double e = ulp_error(x[i], y[i]);
    (ref < FLT_MIN ? worst_subnormal : worst_normal) = std::max(
        ref < FLT_MIN ? worst_subnormal : worst_normal, e);
    ASSERT_LT(e, 1.0) << "exp(" << std::hexfloat << x[i] << ") = " << y[i] << ", want " << ref;
    ++checked;
  }
  EXPECT_GT(checked, int64_t{1} << 23);
  // The whole line measured when the bound was written: 0.990 ulp, 0.75 subnormal steps.
  std::printf("worst error: %.3f ulp (normal), %.3f steps of 2^-149 (subnormal)\n", worst_normal,
              worst_subnormal);
}

// Densely around the edges: where the result leaves the normal range, where it overflows, and
// the special values.
TEST(VecMath, ExpEdges) {
  std::vector<float> x;
  for (float c : {-87.3365448f, -103.972f, 88.7228394f, 0.0f, -0.34657359f, 0.34657359f}) {
    float v = c;
    for (int i = 0; i < 4096; ++i) v = std::nextafter(v, -INFINITY);
    for (int i = 0; i < 8192; ++i, v = std::nextafter(v, INFINITY)) x.push_back(v);
  }
  for (float v = -120.0f; v <= 100.0f; v += 0.0625f) x.push_back(v);
  std::vector<float> y(x.size());
  exp_baseline(y.data(), x.data(), static_cast<int64_t>(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double ref = std::exp(static_cast<double>(x[i]));
    if (ref > FLT_MAX) {
      EXPECT_EQ(y[i], INFINITY) << x[i];
    } else {
      EXPECT_LT(ulp_error(x[i], y[i]), 1.0) << std::hexfloat << x[i] << " -> " << y[i];
    }
  }
  EXPECT_EQ(exp_f32(0.0f), 1.0f);
  EXPECT_EQ(exp_f32(-0.0f), 1.0f);
  EXPECT_EQ(exp_f32(-INFINITY), 0.0f);
  EXPECT_EQ(exp_f32(-200.0f), 0.0f);
  EXPECT_EQ(exp_f32(-104.0f), 0.0f);                  // e^-104 < 2^-150: rounds to 0
  EXPECT_EQ(exp_f32(-103.9f), 0x1p-149f);             // the smallest subnormal
  EXPECT_EQ(exp_f32(INFINITY), INFINITY);
  EXPECT_EQ(exp_f32(88.73f), INFINITY);
  EXPECT_EQ(exp_f32(1000.0f), INFINITY);
  EXPECT_LE(exp_f32(88.72f), FLT_MAX);
  EXPECT_TRUE(std::isnan(exp_f32(NAN)));
  EXPECT_TRUE(std::isnan(exp_f32(-NAN)));
}

// A value's result does not depend on its lane or on how long the array is.
TEST(VecMath, ExpSameBitsInEveryLaneAndTail) {
  std::vector<float> x(29);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = -30.0f + 2.3f * static_cast<float>(i);
  std::vector<float> single(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) single[i] = exp_f32(x[i]);
  for (int64_t n = 1; n <= static_cast<int64_t>(x.size()); ++n) {
    for (int64_t off = 0; off + n <= static_cast<int64_t>(x.size()); off += 3) {
      std::vector<float> y(static_cast<std::size_t>(n));
      exp_baseline(y.data(), x.data() + off, n);
      EXPECT_EQ(0, std::memcmp(y.data(), single.data() + off, sizeof(float) * n))
          << "n=" << n << " offset=" << off;
    }
  }
}

// The same bits from code built for AVX2 + FMA, and from 16 lanes built for AVX-512, as from
// baseline x86-64 code: kernels built with target_clones or a wide path rely on it.
TEST(VecMath, ExpSameBitsForEveryInstructionSet) {
#ifdef MOETRAIN_TEST_AVX2
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
    GTEST_SKIP() << "this CPU has no AVX2/FMA";
  const std::vector<float> x = sweep(4099);
  std::vector<float> a(x.size()), b(x.size());
  exp_baseline(a.data(), x.data(), static_cast<int64_t>(x.size()));
  exp_avx2(b.data(), x.data(), static_cast<int64_t>(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(a[i]), std::bit_cast<uint32_t>(b[i]))
        << std::hexfloat << "exp(" << x[i] << "): " << a[i] << " vs " << b[i];
  if (!__builtin_cpu_supports("avx512f")) GTEST_SKIP() << "this CPU has no AVX-512";
  exp_avx512(b.data(), x.data(), static_cast<int64_t>(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(a[i]), std::bit_cast<uint32_t>(b[i]))
        << std::hexfloat << "exp(" << x[i] << "), 16 lanes: " << a[i] << " vs " << b[i];
#else
  GTEST_SKIP() << "target attributes need GCC on x86-64";
#endif
}

// log_vd4 against std::log over the softmax sums it serves ([1, 2^20], densely) and over normal
// doubles of every exponent: within 2^-50 of the result (relative, or absolute below 1), so that
// the float a caller rounds it to is std::log's but for results within that of a rounding
// boundary; NaN where x is not a normal positive double.
TEST(VecMath, LogOfDoublesMatchesStdLog) {
  std::vector<double> xs;
  for (double x = 1.0; x < 1048576.0; x *= 1.0001) xs.push_back(x);
  for (int e = -1020; e <= 1020; e += 7)
    for (double f : {1.0, 1.2345678901234567, 1.4142135623730951, 1.4142135623730954, 1.999999})
      xs.push_back(std::ldexp(f, e));
  xs.push_back(1.0);
  while (xs.size() % 4) xs.push_back(2.0);
  for (std::size_t i = 0; i < xs.size(); i += 4) {
    VD4 x, y;
    std::memcpy(&x, &xs[i], sizeof x);
    log_vd4(y, x);
    for (int k = 0; k < 4; ++k) {
      const double want = std::log(xs[i + k]);
      ASSERT_LE(std::abs(y[k] - want), std::ldexp(std::max(1.0, std::abs(want)), -50))
          << std::hexfloat << "log(" << xs[i + k] << "): " << y[k] << " vs " << want;
    }
  }
  VD4 y, x = {1.0, 1.0, 1.0, 1.0};
  log_vd4(y, x);
  EXPECT_EQ(y[0], 0.0);
  x = VD4{0.0, -1.0, std::numeric_limits<double>::infinity(), 1e-310};
  log_vd4(y, x);
  for (int k = 0; k < 4; ++k) EXPECT_TRUE(std::isnan(y[k])) << "lane " << k;
  x = VD4{std::nan(""), 1.0, 1.0, 1.0};
  log_vd4(y, x);
  EXPECT_TRUE(std::isnan(y[0]));
}
