#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "moe/experts.h"
#include "moe_reference.h"
#include "support/error_bound.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

struct ExpertShape {
  std::vector<int64_t> counts;
  int64_t C, F;
};

// Double-precision forward and exact gradients of loss = Σ y ⊙ dy for the experts, each with
// the bound of the float kernels' evaluation (support/error_bound.h). Gradients accumulate onto
// `init` (the test's sentinel).
struct ExpertsReference {
  std::vector<Bounded> y, dx, dw1, dw3, dw2;
};

// SwiGLU's backward as the kernel evaluates it from computed a, b and dh:
//   s = σ(a);  da = dh·b·s·(1 + a·(1 − s));  db = dh·(a·s)
// i.e. da = dh·b·silu'(a), db = dh·silu(a). The errors of a, b and dh are carried through with
// |silu'| ≤ 1.1 and |silu''| ≤ 1/2; the evaluation's own: s within γ(libm + 2) relative, then
// six operations on it (γ_6 of the expression with every term taken in absolute value).
void swiglu_backward_bounded(Bounded a, Bounded b, Bounded dh, Bounded& da, Bounded& db) {
  const double s = 1.0 / (1.0 + std::exp(-a.v));
  const double silu = a.v * s, dsilu = s * (1.0 + a.v * (1.0 - s));
  const double s_err = gamma_n(kLibmUnits + 2);
  // Where the kernel evaluates: |a| and |dh·b| at most these, s and 1 − s within [0, 1].
  const double am = a.mag(), pm = b.mag() * dh.mag();
  da.v = dh.v * b.v * dsilu;
  da.e = kSiluCurvature * a.e * pm +
         std::abs(dsilu) * (std::abs(b.v) * dh.e + std::abs(dh.v) * b.e + b.e * dh.e) +
         gamma_n(6) * pm * (1.0 + 2.0 * am) + pm * s_err * (1.0 + 2.0 * am) * (1.0 + s_err);
  db.v = dh.v * silu;
  db.e = kSiluSlope * a.e * dh.mag() + std::abs(silu) * dh.e +
         gamma_n(kLibmUnits + 4) * (std::abs(silu) + kSiluSlope * a.e) * dh.mag();
}

ExpertsReference reference(const ExpertShape& sh, const float* x, const float* w1, const float* w3,
                           const float* w2, const float* dy, float init = 0.0f) {
  const int64_t C = sh.C, F = sh.F, G = sh.counts.size();
  int64_t R = 0;
  for (int64_t n : sh.counts) R += n;
  ExpertsReference ref;
  ref.y.resize(R * C), ref.dx.resize(R * C);
  // Weight gradients: one float sum over the expert's rows, onto `init`.
  std::vector<BoundedSum> dw1(G * F * C), dw3(G * F * C), dw2(G * C * F);
  for (auto* v : {&dw1, &dw3, &dw2})
    for (BoundedSum& b : *v) b.add(Bounded{init});
  std::vector<Bounded> a(F), b(F), h(F), da(F), db(F);
  int64_t row = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t o = g * F * C;
    for (int64_t r = row; r < row + sh.counts[g]; ++r) {
      const float* xr = x + r * C;
      const float* dyr = dy + r * C;
      for (int64_t f = 0; f < F; ++f) {
        BoundedSum sa, sb;
        for (int64_t c = 0; c < C; ++c)
          sa.add(w1[o + f * C + c], xr[c]), sb.add(w3[o + f * C + c], xr[c]);
        a[f] = sa.result(), b[f] = sb.result();
        h[f] = swiglu_bounded(a[f], b[f]);
      }
      for (int64_t c = 0; c < C; ++c) {
        BoundedSum sy;
        for (int64_t f = 0; f < F; ++f) sy.add(Bounded{w2[o + c * F + f]}, h[f]);
        ref.y[r * C + c] = sy.result();
      }
      for (int64_t f = 0; f < F; ++f) {
        BoundedSum dh;
        for (int64_t c = 0; c < C; ++c) {
          dh.add(dyr[c], w2[o + c * F + f]);
          dw2[o + c * F + f].add(Bounded{dyr[c]}, h[f]);
        }
        swiglu_backward_bounded(a[f], b[f], dh.result(), da[f], db[f]);
        for (int64_t c = 0; c < C; ++c) {
          dw1[o + f * C + c].add(da[f], Bounded{xr[c]});
          dw3[o + f * C + c].add(db[f], Bounded{xr[c]});
        }
      }
      // dx = da·W1 + db·W3: two products into one buffer, one sum of 2F terms.
      for (int64_t c = 0; c < C; ++c) {
        BoundedSum sx;
        for (int64_t f = 0; f < F; ++f) {
          sx.add(da[f], Bounded{w1[o + f * C + c]});
          sx.add(db[f], Bounded{w3[o + f * C + c]});
        }
        ref.dx[r * C + c] = sx.result();
      }
    }
    row += sh.counts[g];
  }
  auto results = [](const std::vector<BoundedSum>& sums) {
    std::vector<Bounded> out;
    for (const BoundedSum& b : sums) out.push_back(b.result());
    return out;
  };
  ref.dw1 = results(dw1), ref.dw3 = results(dw3), ref.dw2 = results(dw2);
  return ref;
}

}  // namespace

class ExpertsTest : public ::testing::TestWithParam<ExpertShape> {};

TEST_P(ExpertsTest, ForwardAndBackwardMatchReference) {
  const ExpertShape sh = GetParam();
  const int64_t C = sh.C, F = sh.F, G = sh.counts.size();
  int64_t R = 0;
  for (int64_t n : sh.counts) R += n;
  auto x = random_vector(R * C, 1), dy = random_vector(R * C, 2);
  auto w1 = random_vector(G * F * C, 3, 0.3f), w3 = random_vector(G * F * C, 4, 0.3f);
  auto w2 = random_vector(G * C * F, 5, 0.3f);
  ExpertRange w{0, G, w1.data(), w3.data(), w2.data()};
  // Gradients start at a sentinel: += for experts with rows, untouched for the others.
  std::vector<float> g1(G * F * C, 0.25f), g3(G * F * C, 0.25f), g2(G * C * F, 0.25f);
  ExpertRange dw{0, G, g1.data(), g3.data(), g2.data()};
  std::vector<float> y(R * C), dx(R * C);
  ExpertActs acts;
  experts_forward(y.data(), x.data(), sh.counts.data(), w, C, F, acts);
  experts_backward(dx.data(), dw, dy.data(), x.data(), sh.counts.data(), w, C, F, acts);
  ExpertsReference ref = reference(sh, x.data(), w1.data(), w3.data(), w2.data(), dy.data(), 0.25f);
  expect_within(y, ref.y, "y");
  expect_within(dx, ref.dx, "dx");
  expect_within(g1, ref.dw1, "dw1");
  expect_within(g3, ref.dw3, "dw3");
  expect_within(g2, ref.dw2, "dw2");
  for (int64_t g = 0; g < G; ++g) {
    if (sh.counts[g] > 0) continue;
    for (int64_t i = g * F * C; i < (g + 1) * F * C; ++i) {
      ASSERT_TRUE(g1[i] == 0.25f && g3[i] == 0.25f && g2[i] == 0.25f) << "idle expert " << g;
    }
  }
}

TEST_P(ExpertsTest, SameBitsWithOneOrTwoThreads) {
  const ExpertShape sh = GetParam();
  const int64_t C = sh.C, F = sh.F, G = sh.counts.size();
  int64_t R = 0;
  for (int64_t n : sh.counts) R += n;
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    auto x = random_vector(R * C, 1), dy = random_vector(R * C, 2);
    auto w1 = random_vector(G * F * C, 3), w3 = random_vector(G * F * C, 4),
         w2 = random_vector(G * C * F, 5);
    std::vector<float> g(3 * G * F * C, 0.0f), y(R * C), dx(R * C);
    ExpertRange w{0, G, w1.data(), w3.data(), w2.data()};
    ExpertRange dw{0, G, g.data(), g.data() + G * F * C, g.data() + 2 * G * F * C};
    ExpertActs acts;
    experts_forward(y.data(), x.data(), sh.counts.data(), w, C, F, acts);
    experts_backward(dx.data(), dw, dy.data(), x.data(), sh.counts.data(), w, C, F, acts);
    y.insert(y.end(), dx.begin(), dx.end());
    y.insert(y.end(), g.begin(), g.end());
    return y;
  };
  int saved = omp_get_max_threads();
  auto a = run(1), b = run(2);
  omp_set_num_threads(saved);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

// Tiny shapes run as plain loops; the others through oneDNN in row blocks of up to 512 rows,
// and the last one reduces over more than 2048 rows in one expert.
INSTANTIATE_TEST_SUITE_P(Shapes, ExpertsTest,
                         ::testing::Values(ExpertShape{{}, 6, 5}, ExpertShape{{0, 0}, 6, 5},
                                           ExpertShape{{1}, 6, 5}, ExpertShape{{2, 0, 3, 1}, 6, 5},
                                           ExpertShape{{0, 3, 300, 0, 513}, 24, 20},
                                           ExpertShape{{2100, 40}, 16, 8}));

TEST(Experts, FiniteDifferencesAgreeWithTheReferenceGradients) {
  const ExpertShape sh{{2, 0, 3}, 6, 5};
  const int64_t C = 6, F = 5, G = 3, R = 5;
  auto x = random_vector(R * C, 7), dy = random_vector(R * C, 8);
  auto w1 = random_vector(G * F * C, 9, 0.5f), w3 = random_vector(G * F * C, 10, 0.5f);
  auto w2 = random_vector(G * C * F, 11, 0.5f);
  ExpertsReference ref = reference(sh, x.data(), w1.data(), w3.data(), w2.data(), dy.data());
  auto loss = [&] {
    ExpertsReference r = reference(sh, x.data(), w1.data(), w3.data(), w2.data(), dy.data());
    double s = 0;
    for (int64_t i = 0; i < R * C; ++i) s += r.y[i].v * dy[i];
    return s;
  };
  auto to_f = [](const std::vector<Bounded>& v) {
    std::vector<float> f;
    for (const Bounded& b : v) f.push_back(static_cast<float>(b.v));
    return f;
  };
  check_gradient(x.data(), to_f(ref.dx).data(), R * C, loss, "dx");
  check_gradient(w1.data(), to_f(ref.dw1).data(), G * F * C, loss, "dw1");
  check_gradient(w3.data(), to_f(ref.dw3).data(), G * F * C, loss, "dw3");
  check_gradient(w2.data(), to_f(ref.dw2).data(), G * C * F, loss, "dw2");
}

TEST(Experts, RangesOfExperts) {
  MoeConfig cfg;
  cfg.C = 4, cfg.F = 3, cfg.E = 5, cfg.K = 1;
  std::vector<float> buf(moe_param_sizes(cfg).total());
  MoeWeights w = moe_weights_from_buffer(cfg, buf.data());
  ExpertRange r = expert_range(w, cfg, 2, 3);
  EXPECT_EQ(r.first, 2);
  EXPECT_EQ(r.count, 3);
  EXPECT_EQ(r.w1, w.w1 + 2 * 12);
  EXPECT_EQ(r.w3, w.w3 + 2 * 12);
  EXPECT_EQ(r.w2, w.w2 + 2 * 12);
  EXPECT_THROW(expert_range(w, cfg, 3, 3), Error);
  EXPECT_THROW(expert_range(w, cfg, -1, 1), Error);
  // A range computes the same as the full set with the other experts given no rows.
  const int64_t C = 4, F = 3;
  std::vector<int64_t> full = {0, 0, 2, 5, 1}, part = {2, 5, 1};
  auto x = random_vector(8 * C, 12);
  for (float& v : buf) v = 0.1f * float((&v - buf.data()) % 7) - 0.3f;
  std::vector<float> y_full(8 * C), y_part(8 * C);
  ExpertActs acts;
  experts_forward(y_full.data(), x.data(), full.data(), expert_range(w, cfg, 0, 5), C, F, acts);
  experts_forward(y_part.data(), x.data(), part.data(), r, C, F, acts);
  EXPECT_EQ(0, std::memcmp(y_full.data(), y_part.data(), y_full.size() * sizeof(float)));
  std::vector<int64_t> negative = {1, -1, 0};
  EXPECT_THROW(experts_forward(y_part.data(), x.data(), negative.data(), r, C, F, acts), Error);
}
