#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/check.h"
#include "moe/balance.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// Rows of random probabilities (positive, sum 1), (N, E).
std::vector<float> random_probs(int64_t N, int64_t E, uint64_t seed) {
  auto v = random_vector(N * E, seed);
  for (int64_t t = 0; t < N; ++t) {
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(v[t * E + e]);
    for (int64_t e = 0; e < E; ++e) v[t * E + e] = static_cast<float>(std::exp(v[t * E + e]) / s);
  }
  return v;
}

double aux_ref(const std::vector<float>& probs, const std::vector<int32_t>& sel, int64_t N,
               int64_t E, int64_t K) {
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) {
    double f = 0, P = 0;
    for (int32_t s : sel) f += s == e;
    for (int64_t t = 0; t < N; ++t) P += probs[t * E + e];
    loss += f / double(N * K) * P / double(N);
  }
  return double(E) * loss;
}

}  // namespace

class BalanceTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(BalanceTest, AuxLossValueAndGradient) {
  const int64_t N = GetParam(), E = 5, K = 2, S = 2;
  auto probs = random_probs(N, E, 11);
  std::vector<int32_t> sel(N * S);
  for (int64_t t = 0; t < N; ++t)
    sel[t * S] = int32_t(t % E), sel[t * S + 1] = int32_t((t * 3 + 1) % E);
  if (N > 2) sel[S + 1] = -1;  // an empty slot counts for nothing
  std::vector<float> f(E);
  double loss = aux_loss_forward(f.data(), probs.data(), sel.data(), N, E, S, K);
  EXPECT_NEAR(loss, N > 0 ? aux_ref(probs, sel, N, E, K) : 0.0, 1e-6);
  for (int64_t e = 0; e < E; ++e) {
    int64_t c = 0;
    for (int32_t s : sel) c += s == e;
    EXPECT_FLOAT_EQ(f[e], N > 0 ? float(double(c) / double(N * K)) : 0.0f);
  }
  if (N == 0) return;
  std::vector<float> dprobs(N * E);
  aux_loss_backward(dprobs.data(), f.data(), N, E, 0.7f);
  for (float& v : dprobs) v /= 0.7f;
  check_gradient(
      probs.data(), dprobs.data(), N * E, [&] { return aux_ref(probs, sel, N, E, K); },
      "aux dprobs");
}

TEST_P(BalanceTest, ZLossValueAndGradient) {
  const int64_t N = GetParam(), E = 6;
  auto logits = random_vector(N * E, 12, 2.0f);
  auto lse_of = [&](int64_t t) {
    double m = -1e30, s = 0;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, double(logits[t * E + e]));
    for (int64_t e = 0; e < E; ++e) s += std::exp(logits[t * E + e] - m);
    return m + std::log(s);
  };
  auto z_ref = [&] {
    double z = 0;
    for (int64_t t = 0; t < N; ++t) z += lse_of(t) * lse_of(t);
    return N > 0 ? z / double(N) : 0.0;
  };
  std::vector<float> lse(N);
  for (int64_t t = 0; t < N; ++t) lse[t] = float(lse_of(t));
  EXPECT_NEAR(z_loss_forward(lse.data(), N), z_ref(), 1e-5 * (1 + z_ref()));
  if (N == 0) return;
  std::vector<float> d(N * E);
  z_loss_backward(d.data(), logits.data(), lse.data(), N, E, 1.0f);
  check_gradient(logits.data(), d.data(), N * E, z_ref, "z dlogits", 1e-2, 1e-4, 1e-3);
}

// The design's definition, literally: importance = probabilities summed over the batch, load =
// their mean, each over its value at perfect balance (N/E and 1/E), variance over the experts.
double variance_ref(const std::vector<float>& probs, int64_t N, int64_t E) {
  std::vector<double> importance(E, 0.0), load(E);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t e = 0; e < E; ++e) importance[e] += probs[t * E + e];
  for (int64_t e = 0; e < E; ++e) load[e] = importance[e] / double(N);
  auto var = [&](const std::vector<double>& v, double balanced) {
    double m = 0, s = 0;
    for (double x : v) m += x / balanced;
    m /= double(E);
    for (double x : v) s += (x / balanced - m) * (x / balanced - m);
    return s / double(E);
  };
  return var(importance, double(N) / double(E)) + var(load, 1.0 / double(E));
}

TEST_P(BalanceTest, VarianceLossValueAndGradient) {
  const int64_t N = GetParam(), E = 5;
  auto probs = random_probs(N, E, 13);
  // A skew, so the gradient is not ~0: expert 0 gets more than its share.
  for (int64_t t = 0; t < N; ++t) probs[t * E] += 0.3f;
  std::vector<float> g(E);
  const double loss = variance_loss_forward(g.data(), probs.data(), N, E);
  if (N == 0) {
    EXPECT_EQ(loss, 0.0);
    return;
  }
  EXPECT_NEAR(loss, variance_ref(probs, N, E), 1e-6 * (1 + loss));
  std::vector<float> dprobs(N * E);
  variance_loss_backward(dprobs.data(), g.data(), N, E, 0.7f);
  for (float& v : dprobs) v /= 0.7f;
  check_gradient(
      probs.data(), dprobs.data(), N * E, [&] { return variance_ref(probs, N, E); },
      "variance dprobs");
}

INSTANTIATE_TEST_SUITE_P(Tokens, BalanceTest, ::testing::Values(0, 1, 7, 300, 1000));

// The normalisation: the same batch twice over gives the same loss (it does not grow with N), one
// expert taking everything gives E − 1 per term, and a uniform router 0.
TEST(VarianceLoss, IndependentOfBatchSizeAndBoundedLikeTheSwitchLoss) {
  const int64_t N = 40, E = 8;
  auto probs = random_probs(N, E, 21);
  std::vector<float> twice(probs);
  twice.insert(twice.end(), probs.begin(), probs.end());
  std::vector<float> g(E), g2(E);
  const double once = variance_loss_forward(g.data(), probs.data(), N, E);
  EXPECT_GT(once, 0.0);
  EXPECT_NEAR(variance_loss_forward(g2.data(), twice.data(), 2 * N, E), once, 1e-9 * once);
  for (int64_t e = 0; e < E; ++e) EXPECT_FLOAT_EQ(g2[e], g[e]);
  std::vector<float> one(N * E, 0.0f), uniform(N * E, 1.0f / float(E));
  for (int64_t t = 0; t < N; ++t) one[t * E + 3] = 1.0f;
  EXPECT_NEAR(variance_loss_forward(g.data(), one.data(), N, E), 2.0 * double(E - 1), 1e-9);
  EXPECT_NEAR(variance_loss_forward(g.data(), uniform.data(), N, E), 0.0, 1e-12);
}

TEST(BiasUpdate, SignOfMeanMinusLoad) {
  std::vector<float> b = {0.5f, 0.5f, 0.5f, 0.5f};
  const int64_t load[] = {10, 2, 6, 6};  // mean 6
  bias_update(b.data(), load, 4, 0.01f);
  EXPECT_FLOAT_EQ(b[0], 0.49f);
  EXPECT_FLOAT_EQ(b[1], 0.51f);
  EXPECT_EQ(b[2], 0.5f);
  EXPECT_EQ(b[3], 0.5f);
  std::vector<float> c = {0.0f, 0.0f};
  const int64_t odd[] = {1, 2};  // mean 1.5 is not an integer
  bias_update(c.data(), odd, 2, 1e-3f);
  EXPECT_EQ(c[0], 1e-3f);
  EXPECT_EQ(c[1], -1e-3f);
  const int64_t even[] = {0, 0};
  bias_update(c.data(), even, 2, 1e-3f);
  EXPECT_EQ(c[0], 1e-3f);
  const int64_t negative[] = {-1, 3};
  EXPECT_THROW(bias_update(c.data(), negative, 2, 1e-3f), Error);
}
