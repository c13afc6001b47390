#include <gtest/gtest.h>

#include <bit>
#include <cmath>

#include "kernels/activation.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {
double silu_ref(double x) {
  return x / (1.0 + std::exp(-x));
}
}  // namespace

class ActivationTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(ActivationTest, SwigluForwardBackward) {
  const int64_t n = GetParam();
  auto a = random_vector(n, 1, 2.0f), b = random_vector(n, 2), dout = random_vector(n, 3);
  std::vector<float> out(n), da(n), db(n);
  swiglu_forward(out.data(), a.data(), b.data(), n);
  std::vector<double> ref(n);
  for (int64_t i = 0; i < n; ++i) ref[i] = silu_ref(a[i]) * b[i];
  expect_close(out.data(), ref.data(), n, 1e-6, 1e-5, "swiglu forward");
  swiglu_backward(da.data(), db.data(), dout.data(), a.data(), b.data(), n);
  auto loss = [&] {
    std::vector<float> o(n);
    swiglu_forward(o.data(), a.data(), b.data(), n);
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += double(o[i]) * dout[i];
    return s;
  };
  check_gradient(a.data(), da.data(), n, loss, "swiglu da");
  check_gradient(b.data(), db.data(), n, loss, "swiglu db");
}

TEST_P(ActivationTest, SiluForwardBackward) {
  const int64_t n = GetParam();
  auto x = random_vector(n, 4, 3.0f), dout = random_vector(n, 5);
  std::vector<float> out(n), dx(n);
  silu_forward(out.data(), x.data(), n);
  std::vector<double> ref(n);
  for (int64_t i = 0; i < n; ++i) ref[i] = silu_ref(x[i]);
  expect_close(out.data(), ref.data(), n, 1e-6, 1e-5, "silu forward");
  silu_backward(dx.data(), dout.data(), x.data(), n);
  auto loss = [&] {
    std::vector<float> o(n);
    silu_forward(o.data(), x.data(), n);
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += double(o[i]) * dout[i];
    return s;
  };
  check_gradient(x.data(), dx.data(), n, loss, "silu dx");
}

// The 16-bit outputs are the f32 results rounded as bf16(float) / fp16(float) round them, bit for
// bit, NaN, infinities, subnormals and values that round up to the next binade included.
template <class T>
void check_rounded_outputs(int64_t n) {
  auto a = random_vector(n, 6, 4.0f), b = random_vector(n, 7, 3.0f), dout = random_vector(n, 8);
  if (n > 4) {
    a[0] = NAN, b[1] = INFINITY, a[2] = -200.0f;
    b[3] = std::bit_cast<float>(0x3f80ffffu);  // rounds to even upwards
    a[4] = 1e-38f, b[4] = 0.5f;                // a subnormal result
  }
  std::vector<float> out(n), da(n), db(n);
  std::vector<T> out_lp(n), da_lp(n), db_lp(n);
  swiglu_forward(out.data(), a.data(), b.data(), n);
  swiglu_forward(out_lp.data(), a.data(), b.data(), n);
  swiglu_backward(da.data(), db.data(), dout.data(), a.data(), b.data(), n);
  swiglu_backward(da_lp.data(), db_lp.data(), dout.data(), a.data(), b.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(out_lp[i].bits, T(out[i]).bits) << "out " << i << ": " << out[i];
    ASSERT_EQ(da_lp[i].bits, T(da[i]).bits) << "da " << i << ": " << da[i];
    ASSERT_EQ(db_lp[i].bits, T(db[i]).bits) << "db " << i << ": " << db[i];
  }
}

TEST_P(ActivationTest, SwigluRoundedOutputsBf16) {
  check_rounded_outputs<bf16>(GetParam());
}

TEST_P(ActivationTest, SwigluRoundedOutputsFp16) {
  check_rounded_outputs<fp16>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Sizes, ActivationTest, ::testing::Values(0, 1, 7, 33, 70000));
