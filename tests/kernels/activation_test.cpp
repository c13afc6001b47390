#include <gtest/gtest.h>

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

INSTANTIATE_TEST_SUITE_P(Sizes, ActivationTest, ::testing::Values(0, 1, 7, 33, 70000));
