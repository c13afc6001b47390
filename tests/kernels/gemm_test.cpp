#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/gemm.h"
#include "support/error_bound.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// C (M, N) = op(A) · op(B) [+ C0] in double, A/B stored as gemm() documents, C0 packed. Each
// element carries the bound of a float GEMM in any summation order (support/error_bound.h).
// u_in: unit roundoff of the format the kernel rounds A and B to first (0: used as they are).
std::vector<Bounded> ref_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A,
                              const float* B, int64_t lda, int64_t ldb, const float* C0 = nullptr,
                              double u_in = 0) {
  std::vector<Bounded> C(M * N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      BoundedSum s;
      if (C0) s.add(Bounded{C0[i * N + j]});
      for (int64_t k = 0; k < K; ++k) {
        double a = ta ? A[k * lda + i] : A[i * lda + k];
        double b = tb ? B[j * ldb + k] : B[k * ldb + j];
        s.add(rounded_operand(a, u_in), rounded_operand(b, u_in));
      }
      C[i * N + j] = s.result();
    }
  return C;
}

std::vector<float> rounded_bf16(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = bf16_round(v[i]);
  return r;
}

}  // namespace

using GemmShape = std::tuple<int64_t, int64_t, int64_t, bool, bool>;  // M, N, K, transA, transB

class GemmTest : public ::testing::TestWithParam<GemmShape> {};

TEST_P(GemmTest, F32MatchesDoubleReference) {
  auto [M, N, K, ta, tb] = GetParam();
  auto A = random_vector(M * K, 1), B = random_vector(K * N, 2);
  std::vector<float> C(M * N, 123.0f);
  gemm(ta ? Trans::T : Trans::N, tb ? Trans::T : Trans::N, M, N, K, A.data(), B.data(), C.data(),
       false);
  auto ref = ref_gemm(ta, tb, M, N, K, A.data(), B.data(), ta ? M : K, tb ? K : N);
  expect_within(C.data(), ref.data(), M * N, "f32 gemm");

  // Accumulate: C += op(A)·op(B) on top of the previous result (one more term in each sum).
  const std::vector<float> C0 = C;
  gemm(ta ? Trans::T : Trans::N, tb ? Trans::T : Trans::N, M, N, K, A.data(), B.data(), C.data(),
       true);
  ref = ref_gemm(ta, tb, M, N, K, A.data(), B.data(), ta ? M : K, tb ? K : N, C0.data());
  expect_within(C.data(), ref.data(), M * N, "f32 gemm accumulate");
}

TEST_P(GemmTest, Bf16MatchesF32WithinBf16Tolerance) {
  auto [M, N, K, ta, tb] = GetParam();
  auto A = random_vector(M * K, 3), B = random_vector(K * N, 4);
  std::vector<bf16> Ab(A.size()), Bb(B.size());
  f32_to_bf16(Ab.data(), A.data(), A.size());
  f32_to_bf16(Bb.data(), B.data(), B.size());
  std::vector<float> C(M * N);
  gemm(ta ? Trans::T : Trans::N, tb ? Trans::T : Trans::N, M, N, K, Ab.data(), Bb.data(), C.data(),
       false);
  // Exact products of the bf16-rounded inputs, accumulated in f32 (natively or widened): the f32
  // bound against that reference.
  auto Ar = rounded_bf16(A), Br = rounded_bf16(B);
  auto ref = ref_gemm(ta, tb, M, N, K, Ar.data(), Br.data(), ta ? M : K, tb ? K : N);
  expect_within(C.data(), ref.data(), M * N, "bf16 gemm vs rounded-input reference");
  // Against the f32 inputs: each operand also carries its bf16 rounding, 2^-8 relative.
  auto ref32 =
      ref_gemm(ta, tb, M, N, K, A.data(), B.data(), ta ? M : K, tb ? K : N, nullptr, kUnitBf16);
  expect_within(C.data(), ref32.data(), M * N, "bf16 gemm vs f32");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmTest,
    ::testing::Values(GemmShape{0, 5, 3, false, false}, GemmShape{5, 0, 3, false, true},
                      GemmShape{4, 3, 0, false, false}, GemmShape{1, 1, 1, false, false},
                      GemmShape{1, 1, 1, true, true}, GemmShape{7, 13, 5, false, false},
                      GemmShape{7, 13, 5, true, false}, GemmShape{7, 13, 5, false, true},
                      GemmShape{7, 13, 5, true, true}, GemmShape{64, 33, 129, false, true},
                      GemmShape{130, 64, 96, true, false}));

// The bounds are rounding-sized, far below what a wrong product moves: against a reference with
// one term dropped, or with one operand read at a neighbouring index, nearly every element of a
// correct (blocked oneDNN) product lies outside them.
TEST(Gemm, BoundsCatchADroppedTermOrAWrongIndex) {
  const int64_t M = 64, N = 33, K = 129;
  auto A = random_vector(M * K, 16), B = random_vector(K * N, 17);
  std::vector<float> C(M * N);
  gemm(Trans::N, Trans::N, M, N, K, A.data(), B.data(), C.data(), false);
  auto fraction_outside = [&](const std::vector<Bounded>& ref) {
    return double(count_outside(C.data(), ref.data(), M * N)) / double(M * N);
  };
  EXPECT_EQ(fraction_outside(ref_gemm(false, false, M, N, K, A.data(), B.data(), K, N)), 0.0);
  // The last k left out (K − 1 columns of A's rows, same leading dimension).
  EXPECT_GT(fraction_outside(ref_gemm(false, false, M, N, K - 1, A.data(), B.data(), K, N)), 0.95);
  // B's column j read as column j + 1.
  std::vector<float> shifted(K * N);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < N; ++j) shifted[k * N + j] = B[k * N + (j + 1) % N];
  EXPECT_GT(fraction_outside(ref_gemm(false, false, M, N, K, A.data(), shifted.data(), K, N)),
            0.95);
  // Only A's first two columns exchanged.
  std::vector<float> swapped = A;
  for (int64_t i = 0; i < M; ++i) std::swap(swapped[i * K], swapped[i * K + 1]);
  EXPECT_GT(fraction_outside(ref_gemm(false, false, M, N, K, swapped.data(), B.data(), K, N)),
            0.95);
}

TEST(Gemm, ZeroKClearsOrKeeps) {
  std::vector<float> C(6, 5.0f);
  gemm(Trans::N, Trans::N, 2, 3, 0, static_cast<const float*>(nullptr),
       static_cast<const float*>(nullptr), C.data(), true);
  for (float c : C) EXPECT_EQ(c, 5.0f);
  gemm(Trans::N, Trans::N, 2, 3, 0, static_cast<const float*>(nullptr),
       static_cast<const float*>(nullptr), C.data(), false);
  for (float c : C) EXPECT_EQ(c, 0.0f);
}

TEST(Gemm, LeadingDimensions) {
  // A is the left 3 columns of a (4, 8) buffer; C the left 5 columns of a (4, 6) buffer.
  auto A = random_vector(4 * 8, 5), B = random_vector(3 * 5, 6);
  std::vector<float> C(4 * 6, -7.0f);
  gemm(Trans::N, Trans::N, 4, 5, 3, A.data(), B.data(), C.data(), false, 8, 5, 6);
  auto ref = ref_gemm(false, false, 4, 5, 3, A.data(), B.data(), 8, 5);
  for (int i = 0; i < 4; ++i) {
    expect_within(C.data() + i * 6, ref.data() + i * 5, 5, "row");
    EXPECT_EQ(C[i * 6 + 5], -7.0f) << "column outside C touched";
  }
  EXPECT_THROW(gemm(Trans::N, Trans::N, 4, 5, 3, A.data(), B.data(), C.data(), false, 2, 5, 6),
               Error);
}

TEST(Linear, ForwardBackwardFiniteDifferences) {
  const int64_t N = 5, IC = 7, OC = 4;
  auto x = random_vector(N * IC, 7), W = random_vector(OC * IC, 8), R = random_vector(N * OC, 9);
  std::vector<float> y(N * OC), dx(N * IC), dW(OC * IC, 0.0f);
  linear_forward(y.data(), x.data(), W.data(), N, IC, OC);
  auto ref = ref_gemm(false, true, N, OC, IC, x.data(), W.data(), IC, IC);
  expect_within(y.data(), ref.data(), N * OC, "linear forward");
  linear_backward(dx.data(), dW.data(), R.data(), x.data(), W.data(), N, IC, OC);
  auto loss = [&] {
    std::vector<float> o(N * OC);
    linear_forward(o.data(), x.data(), W.data(), N, IC, OC);
    double s = 0;
    for (int64_t i = 0; i < N * OC; ++i) s += double(o[i]) * R[i];
    return s;
  };
  check_gradient(x.data(), dx.data(), N * IC, loss, "linear dx");
  check_gradient(W.data(), dW.data(), OC * IC, loss, "linear dW");
  // Parameter gradients accumulate: dW2 = dW + Rᵀx, where dW itself is Rᵀx within its bound
  // (an accumulating primitive may fold C into its sums, so the two need not be bitwise 2·dW).
  std::vector<float> dW2 = dW;
  linear_backward(nullptr, dW2.data(), R.data(), x.data(), W.data(), N, IC, OC);
  const std::vector<float> zero(OC * IC, 0.0f);
  auto once = ref_gemm(true, false, OC, IC, N, R.data(), x.data(), OC, IC, zero.data());
  auto twice = ref_gemm(true, false, OC, IC, N, R.data(), x.data(), OC, IC, dW.data());
  std::vector<Bounded> want(OC * IC);
  for (int64_t i = 0; i < OC * IC; ++i) want[i] = {2 * once[i].v, twice[i].e + once[i].e};
  expect_within(dW.data(), once.data(), OC * IC, "linear dW");
  expect_within(dW2.data(), want.data(), OC * IC, "linear dW accumulated twice");
}

class GroupedGemmTest : public ::testing::TestWithParam<bool> {};

TEST_P(GroupedGemmTest, MatchesLoopOfPlainGemmsWithEmptyGroups) {
  const bool tb = GetParam();
  const int64_t G = 6, N = 24, K = 40;
  const std::vector<int64_t> M = {5, 0, 17, 1, 0, 64};
  int64_t total = 0;
  for (auto m : M) total += m;
  auto A = random_vector(total * K, 10), B = random_vector(G * K * N, 11);
  std::vector<float> C(total * N, 9.0f), C_ref(total * N, 0.0f);
  grouped_gemm(tb ? Trans::T : Trans::N, G, M.data(), N, K, A.data(), B.data(), K * N, C.data(),
               false);
  int64_t row = 0;
  for (int64_t g = 0; g < G; ++g) {
    gemm(Trans::N, tb ? Trans::T : Trans::N, M[g], N, K, A.data() + row * K, B.data() + g * K * N,
         C_ref.data() + row * N, false);
    row += M[g];
  }
  // The grouped primitive binds M at run time and the plain one does not: two primitives, which
  // oneDNN may give different kernels (blocking, summation order), so they agree within the sum
  // of their bounds rather than bitwise.
  std::vector<Bounded> ref;
  row = 0;
  for (int64_t g = 0; g < G; ++g) {
    auto part =
        ref_gemm(false, tb, M[g], N, K, A.data() + row * K, B.data() + g * K * N, K, tb ? K : N);
    ref.insert(ref.end(), part.begin(), part.end());
    row += M[g];
  }
  expect_within(C.data(), ref.data(), total * N, "grouped vs double");
  expect_within(C_ref.data(), ref.data(), total * N, "loop of gemm vs double");
  expect_agree(C.data(), C_ref.data(), ref, "grouped vs loop");

  // Changing the row counts must not build new primitives (runtime M).
  int64_t built = gemm_primitives_built();
  const std::vector<int64_t> M2 = {3, 9, 0, 0, 50, 25};
  grouped_gemm(tb ? Trans::T : Trans::N, G, M2.data(), N, K, A.data(), B.data(), K * N, C.data(),
               false);
  EXPECT_EQ(gemm_primitives_built(), built);
}

TEST_P(GroupedGemmTest, Bf16MatchesF32Loop) {
  const bool tb = GetParam();
  const int64_t G = 4, N = 16, K = 32;
  const std::vector<int64_t> M = {0, 7, 33, 2};
  const int64_t total = 42;
  auto A = random_vector(total * K, 12), B = random_vector(G * K * N, 13);
  auto Ar = rounded_bf16(A), Br = rounded_bf16(B);
  std::vector<bf16> Ab(A.size()), Bb(B.size());
  f32_to_bf16(Ab.data(), A.data(), A.size());
  f32_to_bf16(Bb.data(), B.data(), B.size());
  std::vector<float> C(total * N), C_ref(total * N);
  grouped_gemm(tb ? Trans::T : Trans::N, G, M.data(), N, K, Ab.data(), Bb.data(), K * N, C.data(),
               false);
  grouped_gemm(tb ? Trans::T : Trans::N, G, M.data(), N, K, Ar.data(), Br.data(), K * N,
               C_ref.data(), false);
  // A native bf16 primitive against the f32 one: each within the f32 bound over the rounded
  // operands (where bf16 is widened, both run the same f32 primitive and agree bitwise).
  std::vector<Bounded> ref;
  int64_t row = 0;
  for (int64_t g = 0; g < G; ++g) {
    auto part =
        ref_gemm(false, tb, M[g], N, K, Ar.data() + row * K, Br.data() + g * K * N, K, tb ? K : N);
    ref.insert(ref.end(), part.begin(), part.end());
    row += M[g];
  }
  expect_within(C.data(), ref.data(), total * N, "bf16 grouped vs double");
  expect_agree(C.data(), C_ref.data(), ref, "bf16 grouped vs f32");
}

INSTANTIATE_TEST_SUITE_P(Trans, GroupedGemmTest, ::testing::Bool());

TEST(GroupedGemmReduce, WeightGradientsPerGroup) {
  const int64_t G = 5, P = 12, Q = 20;
  const std::vector<int64_t> M = {4, 0, 31, 1, 0};
  int64_t total = 36;
  auto A = random_vector(total * P, 14), B = random_vector(total * Q, 15);
  std::vector<float> C(G * P * Q, 1.5f);
  grouped_gemm_reduce(G, M.data(), P, Q, A.data(), B.data(), C.data(), P * Q, true);
  int64_t row = 0;
  for (int64_t g = 0; g < G; ++g) {
    const std::vector<float> C0(P * Q, 1.5f);
    auto ref =
        ref_gemm(true, false, P, Q, M[g], A.data() + row * P, B.data() + row * Q, P, Q, C0.data());
    expect_within(C.data() + g * P * Q, ref.data(), P * Q, "reduce accumulate");
    row += M[g];
  }
  // Empty groups untouched when accumulating, zeroed when not.
  for (int64_t i = 0; i < P * Q; ++i) ASSERT_EQ(C[1 * P * Q + i], 1.5f);
  grouped_gemm_reduce(G, M.data(), P, Q, A.data(), B.data(), C.data(), P * Q, false);
  for (int64_t i = 0; i < P * Q; ++i) ASSERT_EQ(C[4 * P * Q + i], 0.0f);
  int64_t built = gemm_primitives_built();
  const std::vector<int64_t> M2 = {2, 2, 2, 20, 10};
  grouped_gemm_reduce(G, M2.data(), P, Q, A.data(), B.data(), C.data(), P * Q, true);
  EXPECT_EQ(gemm_primitives_built(), built);
}
