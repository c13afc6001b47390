#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "core/check.h"
#include "optim/clip.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {
double ref_sum_squares(const std::vector<float>& g, int64_t lo, int64_t hi) {
  long double s = 0;
  for (int64_t i = lo; i < hi; ++i) s += static_cast<long double>(g[i]) * g[i];
  return static_cast<double>(s);
}
}  // namespace

class ClipTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(ClipTest, NormMatchesReferenceAndClips) {
  const int64_t n = GetParam();
  auto g = random_vector(n, 21, 0.5f);
  const double ref = std::sqrt(ref_sum_squares(g, 0, n));
  EXPECT_NEAR(grad_norm(g.data(), n), ref, 1e-12 * (1 + ref));
  // Below the threshold: untouched.
  auto same = g;
  EXPECT_NEAR(clip_grad_norm(same.data(), n, ref * 2 + 1), ref, 1e-12 * (1 + ref));
  EXPECT_EQ(std::memcmp(same.data(), g.data(), n * sizeof(float)), 0);
  if (n == 0) return;
  // Above: scaled by max_norm / (norm + 1e-6), returning the pre-clip norm.
  const double max_norm = ref / 3;
  auto clipped = g;
  EXPECT_NEAR(clip_grad_norm(clipped.data(), n, max_norm), ref, 1e-12 * (1 + ref));
  const double after = grad_norm(clipped.data(), n);
  EXPECT_LE(after, max_norm * (1 + 1e-6));
  EXPECT_NEAR(after, max_norm * ref / (ref + 1e-6), 1e-6 * max_norm);
  const float coef = static_cast<float>(max_norm / (ref + 1e-6));
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(clipped[i], g[i] * coef) << i;
}

TEST_P(ClipTest, SumOfPartsIsTheWholeNorm) {
  // The distributed use: each rank's sum of squares, added up, gives the global norm.
  const int64_t n = GetParam();
  auto g = random_vector(n, 22);
  const int64_t k = n / 3;
  const double parts = grad_sum_squares(g.data(), k) + grad_sum_squares(g.data() + k, n - k);
  EXPECT_NEAR(parts, ref_sum_squares(g, 0, n), 1e-12 * (1 + parts));
  EXPECT_NEAR(grad_sum_squares(g.data() + k, n - k), ref_sum_squares(g, k, n), 1e-12 * (1 + parts));
}

TEST_P(ClipTest, DetectsNonFinite) {
  const int64_t n = GetParam();
  auto g = random_vector(n, 23, 1e30f);  // huge but finite
  EXPECT_FALSE(has_non_finite(g.data(), n));
  if (n == 0) return;
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    for (int64_t at : {int64_t(0), n / 2, n - 1}) {
      auto h = g;
      h[at] = bad;
      EXPECT_TRUE(has_non_finite(h.data(), n)) << "value " << bad << " at " << at;
      EXPECT_FALSE(std::isfinite(grad_norm(h.data(), n)));
      // A non-finite norm leaves the gradients for the caller to reject.
      auto before = h;
      clip_grad_norm(h.data(), n, 1.0);
      EXPECT_EQ(std::memcmp(h.data(), before.data(), n * sizeof(float)), 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, ClipTest, ::testing::Values(0, 1, 7, 4096, 4097, 100003));

TEST(Clip, NormIsBitwiseIndependentOfThreads) {
  const int64_t n = 300001;
  auto g = random_vector(n, 24);
  const int saved = omp_get_max_threads();
  double norms[2];
  std::vector<float> clipped[2];
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    norms[threads - 1] = grad_norm(g.data(), n);
    clipped[threads - 1] = g;
    clip_grad_norm(clipped[threads - 1].data(), n, 1.0);
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(std::memcmp(&norms[0], &norms[1], sizeof(double)), 0) << norms[0] << " vs " << norms[1];
  EXPECT_EQ(std::memcmp(clipped[0].data(), clipped[1].data(), n * sizeof(float)), 0);
}

TEST(Clip, RejectsBadMaxNorm) {
  std::vector<float> g(3, 1.0f);
  for (double bad : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN()}) {
    try {
      clip_grad_norm(g.data(), 3, bad);
      ADD_FAILURE() << "no error for max_norm " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("max_norm"), std::string::npos) << e.what();
    }
  }
  EXPECT_DOUBLE_EQ(clip_coefficient(2.0, 1.0), 1.0 / (2.0 + 1e-6));
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0);
  EXPECT_EQ(clip_coefficient(1.0, 1.0), 1.0);
}
