#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>

#include "core/check.h"
#include "kernels/rope.h"
#include "support/expect_error.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {
// Bitwise equality (memcmp would be handed null pointers for empty buffers).
bool same_bits(const float* a, const float* b, int64_t n) {
  return n == 0 || std::memcmp(a, b, sizeof(float) * n) == 0;
}
constexpr float kTheta = 10000.0f;

// transformers' cos/sin: inv_freq and the angle in float32, then cos/sin of that float angle; the
// rotation itself in double.
std::vector<double> rope_ref(const std::vector<float>& x, const std::vector<int32_t>& pos,
                             int64_t N, int64_t NH, int64_t HS, float theta) {
  const int64_t half = HS / 2;
  std::vector<double> out(N * NH * HS);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < half; ++i) {
      const float inv_freq = 1.0f / std::pow(theta, float(2 * i) / float(HS));
      const float angle = float(pos[n]) * inv_freq;
      const double c = std::cos(double(angle)), s = std::sin(double(angle));
      for (int64_t h = 0; h < NH; ++h) {
        const int64_t b = (n * NH + h) * HS;
        out[b + i] = x[b + i] * c - x[b + i + half] * s;
        out[b + i + half] = x[b + i + half] * c + x[b + i] * s;
      }
    }
  }
  return out;
}

std::vector<int32_t> make_pos(int64_t N, uint64_t seed) {
  std::vector<int32_t> pos(N);
  Rng rng(seed, rng_stream(RngPurpose::Test, 2, 0));
  for (int64_t n = 0; n < N; ++n) pos[n] = static_cast<int32_t>(rng.below(n, 5000));
  if (N > 0) pos[0] = 0;
  if (N > 2) pos[2] = 131071;  // a long-context position, where float32 angle rounding matters
  return pos;
}

}  // namespace

class RopeTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t>> {};

TEST_P(RopeTest, ForwardMatchesReferenceInPlaceAndTable) {
  const auto [N, NH, HS] = GetParam();
  const int64_t n_all = N * NH * HS;
  auto x = random_vector(n_all, 1, 2.0f);
  auto pos = make_pos(N, 2);
  std::vector<float> out(n_all);
  rope_forward(out.data(), x.data(), pos.data(), N, NH, HS, kTheta);
  auto ref = rope_ref(x, pos, N, NH, HS, kTheta);
  expect_close(out.data(), ref.data(), n_all, 1e-6, 1e-6, "rope forward");

  std::vector<float> inplace = x;
  rope_forward(inplace.data(), inplace.data(), pos.data(), N, NH, HS, kTheta);
  EXPECT_TRUE(same_bits(inplace.data(), out.data(), n_all));

  RopeTable table(131072, HS, kTheta);
  std::vector<float> tabled(n_all);
  rope_forward(tabled.data(), x.data(), pos.data(), N, NH, HS, table);
  EXPECT_TRUE(same_bits(tabled.data(), out.data(), n_all));
}

TEST_P(RopeTest, BackwardFiniteDifferencesInPlaceAndTable) {
  const auto [N, NH, HS] = GetParam();
  const int64_t n_all = N * NH * HS;
  auto x = random_vector(n_all, 3), dout = random_vector(n_all, 4);
  auto pos = make_pos(N, 5);
  std::vector<float> dx(n_all, 3.0f);
  rope_backward(dx.data(), dout.data(), pos.data(), N, NH, HS, kTheta);
  auto loss = [&] {
    std::vector<float> o(n_all);
    rope_forward(o.data(), x.data(), pos.data(), N, NH, HS, kTheta);
    double s = 0;
    for (int64_t i = 0; i < n_all; ++i) s += double(o[i]) * dout[i];
    return s;
  };
  check_gradient(x.data(), dx.data(), n_all, loss, "rope dinp (finite differences)");

  std::vector<float> inplace = dout;
  rope_backward(inplace.data(), inplace.data(), pos.data(), N, NH, HS, kTheta);
  EXPECT_TRUE(same_bits(inplace.data(), dx.data(), n_all));
  RopeTable table(131072, HS, kTheta);
  std::vector<float> tabled = dout;
  rope_backward(tabled.data(), tabled.data(), pos.data(), N, NH, HS, table);
  EXPECT_TRUE(same_bits(tabled.data(), dx.data(), n_all));
}

TEST_P(RopeTest, IsARotation) {
  const auto [N, NH, HS] = GetParam();
  const int64_t n_all = N * NH * HS, half = HS / 2;
  auto x = random_vector(n_all, 6, 3.0f);
  auto pos = make_pos(N, 7);
  std::vector<float> y(n_all), back(n_all);
  rope_forward(y.data(), x.data(), pos.data(), N, NH, HS, kTheta);
  std::vector<double> norm_x(n_all / 2 + 1), norm_y(n_all / 2 + 1);
  for (int64_t t = 0; t < N * NH; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = t * HS + i, b = a + half;
      norm_x[t * half + i] = std::hypot(double(x[a]), double(x[b]));
      norm_y[t * half + i] = std::hypot(double(y[a]), double(y[b]));
    }
  }
  std::vector<float> norm_yf(norm_y.begin(), norm_y.end());
  expect_close(norm_yf.data(), norm_x.data(), N * NH * half, 1e-6, 1e-6, "rope pair norms");
  // The backward is the transpose, i.e. the inverse rotation.
  rope_backward(back.data(), y.data(), pos.data(), N, NH, HS, kTheta);
  expect_close(back.data(), x.data(), n_all, 1e-5, 1e-5, "rope backward(forward(x))");
}

INSTANTIATE_TEST_SUITE_P(Shapes, RopeTest,
                         ::testing::Values(std::make_tuple(0, 2, 8), std::make_tuple(1, 1, 2),
                                           std::make_tuple(1, 3, 16), std::make_tuple(7, 3, 34),
                                           std::make_tuple(64, 5, 64), std::make_tuple(3, 0, 4)));

TEST(Rope, HandComputedValues) {
  // HS = 4, theta = 1e4: inv_freq = {1, 1/100}. At pos 100 the angles are {100, 1}.
  const std::vector<float> x = {1.0f, 2.0f, 3.0f, 4.0f};
  const int32_t pos = 100;
  std::vector<float> y(4);
  rope_forward(y.data(), x.data(), &pos, 1, 1, 4, kTheta);
  const double c0 = std::cos(100.0), s0 = std::sin(100.0), c1 = std::cos(1.0), s1 = std::sin(1.0);
  const std::vector<double> want = {1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0,
                                    4 * c1 + 2 * s1};
  expect_close(y.data(), want.data(), 4, 1e-6, 1e-6, "rope hand values");
  // Position 0 is the identity.
  const int32_t zero = 0;
  rope_forward(y.data(), x.data(), &zero, 1, 1, 4, kTheta);
  EXPECT_EQ(y, x);
}

TEST(Rope, RejectsBadArguments) {
  std::vector<float> x(2 * 6), y(2 * 6);
  std::vector<int32_t> pos = {3, -4};
  expect_error([&] { rope_forward(y.data(), x.data(), pos.data(), 2, 2, 3, kTheta); }, {"HS=3"});
  expect_error([&] { rope_forward(y.data(), x.data(), pos.data(), 2, 1, 6, kTheta); },
               {"token 1", "is -4"});
  expect_error([&] { rope_backward(y.data(), x.data(), pos.data(), 2, 1, 6, kTheta); },
               {"token 1", "is -4"});
  expect_error([&] { rope_forward(y.data(), x.data(), pos.data(), 2, 1, 6, -1.0f); },
               {"theta", "-1"});
  pos = {3, 10};
  RopeTable table(10, 6, kTheta);
  expect_error([&] { rope_forward(y.data(), x.data(), pos.data(), 2, 1, 6, table); },
               {"token 1", "is 10", "[0, 10)"});
  expect_error([&] { rope_backward(y.data(), x.data(), pos.data(), 2, 1, 6, table); },
               {"token 1", "is 10"});
  pos = {3, 9};
  expect_error([&] { rope_forward(y.data(), x.data(), pos.data(), 1, 1, 4, table); },
               {"head size 4", "6"});
  expect_error([] { RopeTable bad(8, 5, kTheta); }, {"HS=5"});
}
