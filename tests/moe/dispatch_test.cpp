#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "moe/dispatch.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// A token-choice routing with S distinct experts per token and random weights; every
// `hole`-th slot is left empty when hole > 0.
Routing random_routing(int64_t N, int64_t E, int64_t S, uint64_t seed, int64_t hole = 0) {
  Routing r;
  r.N = N, r.E = E, r.S = S;
  r.selected.resize(N * S);
  r.weight.resize(N * S);
  Rng rng(seed, 1);
  for (int64_t t = 0; t < N; ++t) {
    int64_t start = static_cast<int64_t>(rng.below(t, E));
    for (int64_t s = 0; s < S; ++s) {
      int64_t i = t * S + s;
      r.selected[i] = static_cast<int32_t>((start + s) % E);
      r.weight[i] = rng.uniform(N + i);
      if (hole > 0 && i % hole == hole - 1) r.selected[i] = -1, r.weight[i] = 0.0f;
    }
  }
  r.expert = r.selected;
  return r;
}

}  // namespace

TEST(ApplyCapacity, DropsLowestWeightFirstTiesToLowerToken) {
  Routing r;
  r.N = 5, r.E = 2, r.S = 1;
  r.selected = {0, 0, 0, 0, 1};
  r.weight = {0.5f, 0.9f, 0.5f, 0.1f, 0.2f};
  r.expert = r.selected;
  EXPECT_EQ(apply_capacity(r, 2), 2);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{0, 0, -1, -1, 1}));
  EXPECT_EQ(r.selected, (std::vector<int32_t>{0, 0, 0, 0, 1}));  // the router's choice is kept
  EXPECT_EQ(apply_capacity(r, 0), 5);
  EXPECT_EQ(r.expert, std::vector<int32_t>(5, -1));
  EXPECT_EQ(apply_capacity(r, 4), 0);
  EXPECT_EQ(r.expert, r.selected);
  EXPECT_THROW(apply_capacity(r, -1), Error);
}

TEST(ApplyCapacity, KeepsExactlyTheCapacityPerExpert) {
  Routing r = random_routing(500, 6, 2, 21);
  const int64_t cap = 70;
  std::vector<int64_t> chosen(6, 0);
  for (int32_t e : r.selected) ++chosen[e];
  int64_t dropped = apply_capacity(r, cap);
  int64_t expect_dropped = 0;
  for (int64_t e = 0; e < 6; ++e) {
    expect_dropped += std::max<int64_t>(0, chosen[e] - cap);
    int64_t kept = 0;
    float min_kept = 2.0f, max_dropped = -1.0f;
    for (int64_t i = 0; i < 500 * 2; ++i) {
      if (r.selected[i] != e) continue;
      if (r.expert[i] == e) {
        ++kept, min_kept = std::min(min_kept, r.weight[i]);
      } else {
        max_dropped = std::max(max_dropped, r.weight[i]);
      }
    }
    EXPECT_EQ(kept, std::min(chosen[e], cap));
    EXPECT_GE(min_kept, max_dropped) << "expert " << e;
  }
  EXPECT_EQ(dropped, expect_dropped);
}

class DispatchTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(DispatchTest, LayoutPermuteCombineAndTheirBackward) {
  const int64_t N = GetParam(), E = 5, S = 3, C = 7;
  Routing r = random_routing(N, E, S, 31, 4);
  DispatchLayout L;
  build_layout(L, r);
  // Counts, offsets, rows grouped by expert in ascending token order, slot_row the inverse.
  int64_t R = 0;
  for (int32_t e : r.expert) R += e >= 0;
  ASSERT_EQ(L.R, R);
  for (int64_t e = 0; e < E; ++e) {
    int64_t n = 0;
    for (int32_t x : r.expert) n += x == e;
    EXPECT_EQ(L.counts[e], n);
    EXPECT_EQ(L.offsets[e + 1] - L.offsets[e], n);
    for (int64_t row = L.offsets[e]; row < L.offsets[e + 1]; ++row) {
      EXPECT_EQ(r.expert[L.row_token[row] * S + L.row_slot[row]], e);
      if (row > L.offsets[e]) {
        EXPECT_LT(L.row_token[row - 1], L.row_token[row]);
      }
      EXPECT_EQ(L.slot_row[L.row_token[row] * S + L.row_slot[row]], row);
      EXPECT_EQ(L.row_weight[row], r.weight[L.row_token[row] * S + L.row_slot[row]]);
    }
  }
  for (int64_t i = 0; i < N * S; ++i) EXPECT_EQ(L.slot_row[i] < 0, r.expert[i] < 0);

  auto x = random_vector(N * C, 32), y = random_vector(R * C, 33), dout = random_vector(N * C, 34);
  std::vector<float> xp(R * C), out(N * C), dy(R * C), dw(N * S), dx(N * C);
  permute_forward(xp.data(), x.data(), L, C);
  for (int64_t row = 0; row < R; ++row) {
    ASSERT_EQ(0, std::memcmp(&xp[row * C], &x[L.row_token[row] * C], C * sizeof(float)));
  }
  // combine: out[t] = Σ_s w · y[row], in slot order.
  combine_forward(out.data(), y.data(), L, C, false);
  std::vector<double> ref(N * C, 0.0), dw_ref(N * S, 0.0), dx_ref(N * C, 0.0);
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t s = 0; s < S; ++s) {
      int64_t row = L.slot_row[t * S + s];
      if (row < 0) continue;
      for (int64_t c = 0; c < C; ++c) {
        ref[t * C + c] += double(r.weight[t * S + s]) * y[row * C + c];
        dw_ref[t * S + s] += double(dout[t * C + c]) * y[row * C + c];
        dx_ref[t * C + c] += y[row * C + c];
      }
    }
  }
  expect_close(out.data(), ref.data(), N * C, 1e-6, 1e-5, "combine");
  std::vector<float> acc(N * C, 1.0f);
  combine_forward(acc.data(), y.data(), L, C, true);
  for (auto& v : ref) v += 1.0;
  expect_close(acc.data(), ref.data(), N * C, 1e-6, 1e-5, "combine accumulate");
  // combine backward: dy[row] = w · dout[token]; dweight = dout · y.
  combine_backward(dy.data(), dw.data(), dout.data(), y.data(), L, C);
  expect_close(dw.data(), dw_ref.data(), N * S, 1e-6, 1e-5, "dweight");
  for (int64_t row = 0; row < R; ++row) {
    for (int64_t c = 0; c < C; ++c) {
      ASSERT_EQ(dy[row * C + c], L.row_weight[row] * dout[L.row_token[row] * C + c]);
    }
  }
  // permute backward: the unweighted combine.
  permute_backward(dx.data(), y.data(), L, C, false);
  expect_close(dx.data(), dx_ref.data(), N * C, 1e-6, 1e-5, "permute backward");
}

INSTANTIATE_TEST_SUITE_P(Tokens, DispatchTest, ::testing::Values(0, 1, 13, 2000));

TEST(Dispatch, SameBitsWithOneOrTwoThreads) {
  const int64_t N = 3000, E = 8, S = 2, C = 64;
  Routing r = random_routing(N, E, S, 41);
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    Routing rr = r;
    apply_capacity(rr, 700);
    DispatchLayout L;
    build_layout(L, rr);
    auto x = random_vector(N * C, 42), dout = random_vector(N * C, 43);
    std::vector<float> xp(L.R * C), out(N * C), dy(L.R * C), dw(N * S), dx(N * C);
    permute_forward(xp.data(), x.data(), L, C);
    combine_forward(out.data(), xp.data(), L, C, false);
    combine_backward(dy.data(), dw.data(), dout.data(), xp.data(), L, C);
    permute_backward(dx.data(), dy.data(), L, C, false);
    std::vector<float> all = out;
    all.insert(all.end(), dw.begin(), dw.end());
    all.insert(all.end(), dx.begin(), dx.end());
    for (int32_t e : rr.expert) all.push_back(float(e));
    return all;
  };
  int saved = omp_get_max_threads();
  auto a = run(1), b = run(2);
  omp_set_num_threads(saved);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}
