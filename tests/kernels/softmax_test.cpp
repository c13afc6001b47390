#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>

#include "core/check.h"
#include "kernels/softmax.h"
#include "support/expect_error.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {
// Bitwise equality (memcmp would be handed null pointers for empty buffers).
bool same_bits(const float* a, const float* b, int64_t n) {
  return n == 0 || std::memcmp(a, b, sizeof(float) * n) == 0;
}
std::vector<double> softmax_ref(const std::vector<float>& x, int64_t N, int64_t V) {
  std::vector<double> p(N * V);
  for (int64_t n = 0; n < N; ++n) {
    double m = -INFINITY, s = 0;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, double(x[n * V + v]));
    for (int64_t v = 0; v < V; ++v) s += std::exp(x[n * V + v] - m);
    for (int64_t v = 0; v < V; ++v) p[n * V + v] = std::exp(x[n * V + v] - m) / s;
  }
  return p;
}

double lse_ref(const float* x, int64_t V) {
  double m = -INFINITY, s = 0;
  for (int64_t v = 0; v < V; ++v) m = std::max(m, double(x[v]));
  for (int64_t v = 0; v < V; ++v) s += std::exp(x[v] - m);
  return m + std::log(s);
}

// Every third row ignored, the others a target spread over [0, V).
std::vector<int32_t> make_targets(int64_t N, int64_t V) {
  std::vector<int32_t> t(N);
  for (int64_t n = 0; n < N; ++n) t[n] = n % 3 == 2 ? -1 : static_cast<int32_t>((n * 7919 + 3) % V);
  return t;
}

}  // namespace

class SoftmaxTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(SoftmaxTest, ForwardBackward) {
  const auto [N, V] = GetParam();
  auto x = random_vector(N * V, 1, 3.0f), dy = random_vector(N * V, 2);
  std::vector<float> out(N * V), dx(N * V);
  softmax_forward(out.data(), x.data(), N, V);
  auto p = softmax_ref(x, N, V);
  expect_close(out.data(), p.data(), N * V, 1e-7, 1e-5, "softmax forward");

  softmax_backward(dx.data(), dy.data(), out.data(), N, V);
  std::vector<double> dref(N * V);
  for (int64_t n = 0; n < N; ++n) {
    double dot = 0;
    for (int64_t v = 0; v < V; ++v) dot += dy[n * V + v] * p[n * V + v];
    for (int64_t v = 0; v < V; ++v) dref[n * V + v] = p[n * V + v] * (dy[n * V + v] - dot);
  }
  expect_close(dx.data(), dref.data(), N * V, 1e-6, 1e-4, "softmax backward");
  auto loss = [&] {
    std::vector<float> o(N * V);
    softmax_forward(o.data(), x.data(), N, V);
    double s = 0;
    for (int64_t i = 0; i < N * V; ++i) s += double(o[i]) * dy[i];
    return s;
  };
  check_gradient(x.data(), dx.data(), N * V, loss, "softmax dinp (finite differences)");

  // In place (out = inp, dinp = dout) gives the same bits.
  std::vector<float> y = x;
  softmax_forward(y.data(), y.data(), N, V);
  EXPECT_TRUE(same_bits(y.data(), out.data(), N * V));
  std::vector<float> g = dy;
  softmax_backward(g.data(), g.data(), out.data(), N, V);
  EXPECT_TRUE(same_bits(g.data(), dx.data(), N * V));
}

TEST_P(SoftmaxTest, XentForwardBackward) {
  const auto [N, V] = GetParam();
  auto x = random_vector(N * V, 3, 3.0f), dl = random_vector(N, 4);
  auto t = make_targets(N, V);
  std::vector<float> losses(N, -1.0f), lse(N), dx(N * V, 9.0f);
  softmax_xent_forward(losses.data(), lse.data(), x.data(), t.data(), N, V);
  std::vector<double> lref(N), lseref(N);
  for (int64_t n = 0; n < N; ++n) {
    lseref[n] = lse_ref(x.data() + n * V, V);
    lref[n] = t[n] < 0 ? 0.0 : lseref[n] - x[n * V + t[n]];
  }
  expect_close(losses.data(), lref.data(), N, 1e-6, 1e-5, "xent losses");
  expect_close(lse.data(), lseref.data(), N, 1e-6, 1e-6, "xent lse");

  softmax_xent_backward(dx.data(), dl.data(), x.data(), lse.data(), t.data(), N, V);
  auto p = softmax_ref(x, N, V);
  std::vector<double> dref(N * V, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    if (t[n] < 0) continue;
    for (int64_t v = 0; v < V; ++v)
      dref[n * V + v] = dl[n] * (p[n * V + v] - (v == t[n] ? 1.0 : 0.0));
  }
  expect_close(dx.data(), dref.data(), N * V, 1e-6, 1e-5, "xent dlogits");
  auto loss = [&] {
    std::vector<float> l(N), s(N);
    softmax_xent_forward(l.data(), s.data(), x.data(), t.data(), N, V);
    double sum = 0;
    for (int64_t n = 0; n < N; ++n) sum += double(l[n]) * dl[n];
    return sum;
  };
  check_gradient(x.data(), dx.data(), N * V, loss, "xent dlogits (finite differences)");

  // In place: dlogits overwrites the logits.
  std::vector<float> inplace = x;
  softmax_xent_backward(inplace.data(), dl.data(), inplace.data(), lse.data(), t.data(), N, V);
  EXPECT_TRUE(same_bits(inplace.data(), dx.data(), N * V));
}

INSTANTIATE_TEST_SUITE_P(Shapes, SoftmaxTest,
                         ::testing::Values(std::make_tuple(0, 5), std::make_tuple(1, 1),
                                           std::make_tuple(1, 7), std::make_tuple(7, 33),
                                           std::make_tuple(64, 257), std::make_tuple(3, 40000)));

TEST(SoftmaxXent, LargeLogitsStayFinite) {
  const int64_t N = 6, V = 1000;
  auto x = random_vector(N * V, 5, 1.0f);
  for (auto& v : x) v = v > 0 ? 1e4f : -1e4f;
  // Row 1 all equal at +1e4: loss must be exactly log V; row 2 mixes ±1e4 with a finite spread.
  for (int64_t v = 0; v < V; ++v) x[V + v] = 1e4f;
  for (int64_t v = 0; v < V; ++v) x[2 * V + v] = 1e4f * std::tanh(0.01f * (v - 500));
  std::vector<int32_t> t = {0, 17, 3, 999, -1, 500};
  std::vector<float> losses(N), lse(N), dl(N, 1.0f), dx(N * V);
  softmax_xent_forward(losses.data(), lse.data(), x.data(), t.data(), N, V);
  softmax_xent_backward(dx.data(), dl.data(), x.data(), lse.data(), t.data(), N, V);
  for (int64_t n = 0; n < N; ++n) {
    ASSERT_TRUE(std::isfinite(losses[n]) && std::isfinite(lse[n])) << "row " << n;
    const double want = t[n] < 0 ? 0.0 : lse_ref(x.data() + n * V, V) - x[n * V + t[n]];
    EXPECT_NEAR(losses[n], want, 1e-6 * std::abs(want) + 1e-5) << "row " << n;
  }
  EXPECT_NEAR(losses[1], std::log(double(V)), 1e-5);
  for (int64_t n = 0; n < N; ++n) {
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) {
      ASSERT_TRUE(std::isfinite(dx[n * V + v])) << "row " << n << " col " << v;
      sum += dx[n * V + v];
    }
    // The saved lse is a float: near 1e4 its rounding (half an ulp, 5e-4) scales every probability
    // by exp(±5e-4), so the row sums to 0 only within that.
    if (t[n] < 0) continue;
    const double ulp = std::nextafter(lse[n], INFINITY) - lse[n];
    EXPECT_NEAR(sum, 0.0, 0.6 * ulp + 1e-5) << "gradient of row " << n << " must sum to 0";
  }
  std::vector<float> y(N * V);
  softmax_forward(y.data(), x.data(), N, V);
  for (float v : y) ASSERT_TRUE(std::isfinite(v));
}

TEST(SoftmaxXent, RejectsBadTargets) {
  const int64_t N = 4, V = 10;
  auto x = random_vector(N * V, 6);
  std::vector<float> losses(N), lse(N), dl(N, 1.0f), dx(N * V);
  std::vector<int32_t> t = {1, 2, 10, 0};
  expect_error([&] { softmax_xent_forward(losses.data(), lse.data(), x.data(), t.data(), N, V); },
               {"row 2", "is 10", "[0, 10)"});
  expect_error(
      [&] { softmax_xent_backward(dx.data(), dl.data(), x.data(), lse.data(), t.data(), N, V); },
      {"row 2", "is 10", "[0, 10)"});
  t = {1, -2, 3, 0};
  expect_error([&] { softmax_xent_forward(losses.data(), lse.data(), x.data(), t.data(), N, V); },
               {"row 1", "is -2"});
  t = {1, 2, 3, 9};
  softmax_xent_forward(losses.data(), lse.data(), x.data(), t.data(), N, V);
  EXPECT_THROW(softmax_forward(dx.data(), x.data(), N, 0), moetrain::Error);
}

// The cross-entropy over a vocabulary split into shards (tensor parallelism), with the shards'
// all-reductions done here by hand (max, then sums in shard order): every row's loss and lse
// against the double-precision reference, and the shards' gradients against
// softmax_xent_backward's columns. The sums regroup float exponentials (each within an ulp) in
// double, so the loss agrees with the reference to a few float ulps of lse (1e-5 relative for
// logits of magnitude ≤ 8), and each gradient element to 1e-6 absolute (dlosses = 1 / N).
TEST(SoftmaxXent, SplitVocabularyMatchesTheWholeRows) {
  for (const auto& [N, V, shards] : {std::tuple<int64_t, int64_t, int64_t>{7, 12, 2},
                                     {9, 33, 3},
                                     {5, 1000, 4},
                                     {1, 8, 8}}) {
    SCOPED_TRACE(::testing::Message() << "N " << N << " V " << V << " shards " << shards);
    std::vector<float> x(N * V);
    for (int64_t i = 0; i < N * V; ++i) x[i] = static_cast<float>(std::sin(0.37 * i) * 8);
    const std::vector<int32_t> t = make_targets(N, V);
    const int64_t Vs = V / shards;
    std::vector<float> rmax(N, -INFINITY), part(N);
    // (shard, N, Vs) copies of each shard's columns, as each rank holds them
    std::vector<std::vector<float>> cols(shards, std::vector<float>(N * Vs));
    for (int64_t s = 0; s < shards; ++s) {
      for (int64_t n = 0; n < N; ++n)
        std::memcpy(cols[s].data() + n * Vs, x.data() + n * V + s * Vs, sizeof(float) * Vs);
      xent_shard_max(part.data(), cols[s].data(), N, Vs);
      for (int64_t n = 0; n < N; ++n) rmax[n] = std::max(rmax[n], part[n]);
    }
    std::vector<double> sums(2 * N, 0.0), psums(2 * N);
    for (int64_t s = 0; s < shards; ++s) {
      xent_shard_sums(psums.data(), cols[s].data(), rmax.data(), t.data(), s * Vs, N, Vs, V);
      for (int64_t i = 0; i < 2 * N; ++i) sums[i] += psums[i];
    }
    std::vector<float> losses(N), lse(N);
    xent_shard_finish(losses.data(), lse.data(), rmax.data(), sums.data(), t.data(), N);
    std::vector<float> full_losses(N), full_lse(N), dlosses(N, 1.0f / N), dfull(N * V);
    softmax_xent_forward(full_losses.data(), full_lse.data(), x.data(), t.data(), N, V);
    softmax_xent_backward(dfull.data(), dlosses.data(), x.data(), full_lse.data(), t.data(), N, V);
    for (int64_t n = 0; n < N; ++n) {
      const double ref = lse_ref(x.data() + n * V, V);
      EXPECT_NEAR(lse[n], ref, 1e-5 * std::abs(ref));
      EXPECT_NEAR(losses[n], t[n] < 0 ? 0.0 : ref - x[n * V + t[n]], 1e-5 * std::abs(ref));
    }
    for (int64_t s = 0; s < shards; ++s) {
      std::vector<float> d(N * Vs);
      softmax_xent_shard_backward(d.data(), dlosses.data(), cols[s].data(), lse.data(), t.data(),
                                  s * Vs, N, Vs, V);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t v = 0; v < Vs; ++v)
          EXPECT_NEAR(d[n * Vs + v], dfull[n * V + s * Vs + v], 1e-6);
    }
  }
  std::vector<float> one(4, 0.0f), lse(1), rmax(1, 0.0f);
  std::vector<double> sums(2);
  const int32_t bad = 9;
  expect_error([&] { xent_shard_sums(sums.data(), one.data(), rmax.data(), &bad, 4, 1, 4, 8); },
               {"xent_shard_sums", "9"});
  expect_error([&] { xent_shard_sums(sums.data(), one.data(), rmax.data(), &bad, 6, 1, 4, 8); },
               {"columns [6, 10)", "8"});
}

// The 16-lane exponentials give the 8-lane ones' bits, values and sum, over row lengths with and
// without a partial vector of either width, a scale g, and terms that underflow.
TEST(Softmax, ExpRowSameBitsOnEveryPath) {
  if (!__builtin_cpu_supports("avx512f")) GTEST_SKIP() << "this CPU has no AVX-512";
  for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 31, 33, 259, 1000}) {
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) x[i] = 0.37f * static_cast<float>((i * 7919) % 211) - 60.0f;
    std::vector<float> narrow(n), wide(n);
    const double a = softmax_exp_row(false, narrow.data(), x.data(), n, 17.0f, 0.3f, true);
    const double b = softmax_exp_row(true, wide.data(), x.data(), n, 17.0f, 0.3f, true);
    ASSERT_EQ(std::memcmp(narrow.data(), wide.data(), sizeof(float) * n), 0) << "n=" << n;
    ASSERT_EQ(std::memcmp(&a, &b, sizeof a), 0) << "n=" << n;
    ASSERT_GT(a, 0.0);
  }
}
