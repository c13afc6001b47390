// The device gradient's reductions and scaling (cuda/grad.cu) against the CPU's (optim/clip.h):
// Σg² within the double rounding of two summation orders, the non-finite count exactly, the
// scaling bitwise, and the same sums on every call.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cuda/device.h"
#include "cuda/kernels.h"
#include "optim/clip.h"
#include "support/random_values.h"

using namespace moetrain;

namespace {

std::vector<float> random_grads(int64_t n, uint32_t seed) {
  return moetrain::testing::normal(n, seed, 0.01f);
}

}  // namespace

TEST(CudaGrad, SumOfSquaresAndScaleMatchTheCpu) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << why;
  cuda::Context ctx;
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{65536}, int64_t{65537}, int64_t{3000001}}) {
    std::vector<float> g = random_grads(n, static_cast<uint32_t>(n));
    cuda::DeviceBuffer<float> d(n);
    d.upload(g.data(), n);
    const cuda::GradSums a = cuda::grad_sums(d.data(), n, ctx.stream());
    const cuda::GradSums b = cuda::grad_sums(d.data(), n, ctx.stream());
    const double want = grad_sum_squares(g.data(), n);
    // Both sum n non-negative double terms: each within n·2^-53 of the exact sum, relatively.
    EXPECT_NEAR(a.sum_squares, want, 2.0 * static_cast<double>(n) * 0x1p-53 * want) << n;
    EXPECT_EQ(a.non_finite, 0u);
    EXPECT_EQ(std::bit_cast<uint64_t>(a.sum_squares), std::bit_cast<uint64_t>(b.sum_squares));
    cuda::scale(d.data(), n, 0.37f, ctx.stream());
    std::vector<float> got(g.size());
    ctx.sync();
    d.download(got.data(), n);
    scale_gradients(g.data(), n, 0.37f);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(g[i])) << n << " " << i;
  }
}

TEST(CudaGrad, NonFiniteValuesAreCountedAndLeftOutOfTheSum) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << why;
  cuda::Context ctx;
  const int64_t n = 200000;
  std::vector<float> g(static_cast<std::size_t>(n), 1.0f);
  g[3] = std::numeric_limits<float>::quiet_NaN();
  g[70000] = std::numeric_limits<float>::infinity();
  g[n - 1] = -std::numeric_limits<float>::infinity();
  cuda::DeviceBuffer<float> d(n);
  d.upload(g.data(), n);
  const cuda::GradSums s = cuda::grad_sums(d.data(), n, ctx.stream());
  EXPECT_EQ(s.non_finite, 3u);
  EXPECT_EQ(s.sum_squares, static_cast<double>(n - 3));
  EXPECT_EQ(cuda::grad_sums(d.data(), 0, ctx.stream()).sum_squares, 0.0);
}
