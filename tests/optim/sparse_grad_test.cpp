// The value-level sparse reduction's pieces (parallel/sparse_grad.h) on one process: the top-k
// selection against a sort-everything reference (ties to the lower position, NaN first), the
// residual making sent + residual = gradient + old residual exactly (f32 and bf16 values), the
// rank-order sum with its per-entry counts (bitwise the dense rank-order sum when every entry is
// sent, −0 included), and error feedback delivering every value over the steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "core/dtype.h"
#include "parallel/sparse_grad.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

struct List {
  std::vector<int32_t> index;
  std::vector<float> value;
};

List read_list(const std::vector<uint8_t>& bytes, int64_t k, GradWire wire) {
  List l;
  l.index.resize(k);
  l.value.resize(k);
  std::memcpy(l.index.data(), bytes.data(), 4 * k);
  for (int64_t j = 0; j < k; ++j) {
    if (wire == GradWire::BF16) {
      uint16_t b;
      std::memcpy(&b, bytes.data() + 4 * k + 2 * j, 2);
      l.value[j] = bf16::from_bits(b).to_float();
    } else {
      std::memcpy(&l.value[j], bytes.data() + 4 * k + 4 * j, 4);
    }
  }
  return l;
}

// Values on few levels, so that many magnitudes tie.
std::vector<float> tied_values(int64_t n, uint64_t seed) {
  std::vector<float> v = random_vector(n, seed, 1.0f);
  for (float& x : v) x = std::round(x * 4.0f) / 4.0f;
  return v;
}

}  // namespace

TEST(SparseGrad, KeepIsTheCeilingAtLeastOneAtMostAll) {
  EXPECT_EQ(sparse_keep(0, 0.5), 0);
  EXPECT_EQ(sparse_keep(1, 0.01), 1);
  EXPECT_EQ(sparse_keep(1000, 0.1), 100);
  EXPECT_EQ(sparse_keep(1001, 0.1), 101);
  EXPECT_EQ(sparse_keep(1000, 0.01), 10);
  EXPECT_EQ(sparse_keep(99, 0.01), 1);
  EXPECT_EQ(sparse_keep(77, 1.0), 77);
  EXPECT_EQ(sparse_list_bytes(10, GradWire::F32), 80);
  EXPECT_EQ(sparse_list_bytes(10, GradWire::BF16), 60);
}

TEST(SparseGrad, TopKMatchesAFullSortAndTheResidualKeepsTheRest) {
  for (GradWire wire : {GradWire::F32, GradWire::BF16}) {
    for (int64_t n : {1, 7, 256, 1000}) {
      for (double ratio : {0.01, 0.1, 0.5, 1.0}) {
        const std::vector<float> g = tied_values(n, 11 + n);
        std::vector<float> r = random_vector(n, 99 + n, 0.25f);
        for (int64_t i = 0; i < n; i += 3) r[i] = 0.0f;  // some positions carry nothing
        std::vector<float> v(n);
        for (int64_t i = 0; i < n; ++i) v[i] = r[i] != 0.0f ? g[i] + r[i] : g[i];
        // Reference: every position sorted by |v| descending, then position ascending.
        std::vector<int32_t> order(n);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
          return std::fabs(v[a]) > std::fabs(v[b]);
        });
        const int64_t k = sparse_keep(n, ratio);
        std::vector<int32_t> want(order.begin(), order.begin() + k);
        std::sort(want.begin(), want.end());

        std::vector<uint8_t> bytes(sparse_list_bytes(k, wire));
        std::vector<uint64_t> scratch;
        std::vector<float> residual = r;
        select_top_k(g.data(), residual.data(), n, k, wire, bytes.data(), scratch);
        const List l = read_list(bytes, k, wire);
        ASSERT_EQ(l.index, want) << "n " << n << " ratio " << ratio;
        std::vector<uint8_t> sent(n, 0);
        for (int64_t j = 0; j < k; ++j) {
          const int32_t i = l.index[j];
          sent[i] = 1;
          const float expect = wire == GradWire::BF16 ? bf16(v[i]).to_float() : v[i];
          EXPECT_EQ(l.value[j], expect);
          // Nothing lost: what was sent plus what is carried is v, exactly.
          EXPECT_EQ(l.value[j] + residual[i], v[i]) << i;
          if (wire == GradWire::F32) {
            EXPECT_EQ(residual[i], 0.0f);
          }
        }
        for (int64_t i = 0; i < n; ++i) {
          if (!sent[i]) {
            EXPECT_EQ(residual[i], v[i]) << i;
          }
        }
      }
    }
  }
}

TEST(SparseGrad, ANonFiniteValueIsSentFirstAndNeverCarried) {
  const int64_t n = 100;
  std::vector<float> g = random_vector(n, 5, 1.0f);
  g[40] = std::numeric_limits<float>::quiet_NaN();
  g[70] = std::numeric_limits<float>::infinity();
  std::vector<float> residual(n, 0.0f);
  std::vector<uint8_t> bytes(sparse_list_bytes(1, GradWire::F32));
  std::vector<uint64_t> scratch;
  select_top_k(g.data(), residual.data(), n, 1, GradWire::F32, bytes.data(), scratch);
  const List l = read_list(bytes, 1, GradWire::F32);
  EXPECT_EQ(l.index[0], 40);
  EXPECT_TRUE(std::isnan(l.value[0]));
  // The Inf was not sent and is not carried into the following steps either.
  EXPECT_EQ(residual[70], 0.0f);
  for (float x : residual) EXPECT_TRUE(std::isfinite(x));
}

TEST(SparseGrad, TheRankOrderSumCountsContributorsAndIsTheDenseSumWhenAllIsSent) {
  const int P = 3;
  const int64_t n = 500;
  std::vector<std::vector<float>> g(P);
  for (int q = 0; q < P; ++q) {
    g[q] = random_vector(n, 300 + q, 1.0f);
    g[q][10] = -0.0f;  // −0 from every rank stays −0, as in the dense sum
  }
  for (double ratio : {1.0, 0.1}) {
    const int64_t k = sparse_keep(n, ratio);
    const int64_t bytes = sparse_list_bytes(k, GradWire::F32);
    std::vector<uint8_t> lists(P * bytes);
    std::vector<std::vector<uint8_t>> sent(P, std::vector<uint8_t>(n, 0));
    std::vector<uint64_t> scratch;
    for (int q = 0; q < P; ++q) {
      std::vector<float> residual(n, 0.0f);
      std::vector<uint8_t> one(bytes);
      select_top_k(g[q].data(), residual.data(), n, k, GradWire::F32, one.data(), scratch);
      std::memcpy(lists.data() + q * bytes, one.data(), bytes);
      for (int32_t i : read_list(one, k, GradWire::F32).index) sent[q][i] = 1;
    }
    std::vector<float> sum(n);
    std::vector<int32_t> counts(n);
    accumulate_lists(sum.data(), counts.data(), n, lists.data(), P, k, GradWire::F32);
    for (int64_t i = 0; i < n; ++i) {
      // Reference: the contributors' values copied then added in rank order.
      float want = 0.0f;
      int c = 0;
      for (int q = 0; q < P; ++q) {
        if (!sent[q][i]) continue;
        want = c == 0 ? g[q][i] : want + g[q][i];
        ++c;
      }
      EXPECT_EQ(counts[i], c) << i;
      EXPECT_EQ(std::memcmp(&sum[i], &want, 4), 0) << i << ": " << sum[i] << " vs " << want;
      if (ratio == 1.0) {
        float dense = g[0][i];
        for (int q = 1; q < P; ++q) dense += g[q][i];
        EXPECT_EQ(std::memcmp(&sum[i], &dense, 4), 0) << i;
      }
    }
    if (ratio == 1.0) {
      EXPECT_TRUE(std::signbit(sum[10]));
    }
  }
}

TEST(SparseGrad, ErrorFeedbackDeliversEveryValueOverTheSteps) {
  // The same gradient every step at ratio 0.1: what was sent over T steps plus the residual left
  // is T·g (within the f32 rounding of the running sums), and every position gets sent (with
  // |g| in [0.5, 1] a position waits at most about 2·n/k steps for its turn).
  const int64_t n = 400;
  const int T = 60;
  std::vector<float> g = random_vector(n, 7, 1.0f);
  for (float& x : g) x = std::copysign(0.5f + 0.5f * std::fabs(x), x);
  const int64_t k = sparse_keep(n, 0.1);
  std::vector<float> residual(n, 0.0f);
  std::vector<double> delivered(n, 0.0);
  std::vector<uint8_t> bytes(sparse_list_bytes(k, GradWire::F32));
  std::vector<uint64_t> scratch;
  for (int t = 0; t < T; ++t) {
    select_top_k(g.data(), residual.data(), n, k, GradWire::F32, bytes.data(), scratch);
    const List l = read_list(bytes, k, GradWire::F32);
    for (int64_t j = 0; j < k; ++j) delivered[l.index[j]] += l.value[j];
  }
  float gmax = 0;
  for (float x : g) gmax = std::max(gmax, std::fabs(x));
  // Each step adds one f32 rounding of a value ≤ T·max|g| to the residual.
  const double bound = T * T * gmax * std::numeric_limits<float>::epsilon();
  int never = 0;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(delivered[i] + residual[i], double(T) * g[i], bound) << i;
    never += delivered[i] == 0.0;
  }
  EXPECT_EQ(never, 0) << "positions never sent in " << T << " steps";
}
