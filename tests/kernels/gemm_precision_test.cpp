// Low-precision GEMM operands: a bf16 or fp16 GEMM is the f32 GEMM of the rounded operands (the
// products are exact in f32, the sums are f32), and a layer computed that way stays within the
// stated distance of the f32 layer.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "kernels/gemm.h"
#include "support/error_bound.h"
#include "support/gradcheck.h"

using namespace moetrain;
using moetrain::testing::Bounded;
using moetrain::testing::BoundedSum;
using moetrain::testing::expect_agree;
using moetrain::testing::expect_within;

namespace {

std::vector<uint16_t> to_lp(DType t, const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  f32_to_dtype(t, out.data(), x.data(), x.size());
  return out;
}
std::vector<float> rounded(DType t, std::vector<float> x) {
  for (float& v : x) v = round_to(t, v);
  return x;
}
// C (M, N) = A (M, K) · op(B) [+ C0] over operands already rounded, with the bound of an f32
// accumulation (support/error_bound.h); B stored (K, N) or, transposed, (N, K).
std::vector<Bounded> ref_gemm(int64_t M, int64_t N, int64_t K, const std::vector<float>& A,
                              const std::vector<float>& B, Trans tb, const float* C0 = nullptr) {
  std::vector<Bounded> C(M * N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      BoundedSum s;
      if (C0) s.add(Bounded{C0[i * N + j]});
      for (int64_t k = 0; k < K; ++k)
        s.add(A[i * K + k], tb == Trans::T ? B[j * K + k] : B[k * N + j]);
      C[i * N + j] = s.result();
    }
  return C;
}

double rel_norm_error(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

TEST(GemmPrecision, LowPrecisionGemmIsTheF32GemmOfRoundedOperands) {
  const int64_t M = 37, N = 29, K = 64;
  const std::vector<float> A = moetrain::testing::random_vector(M * K, 1),
                           B = moetrain::testing::random_vector(K * N, 2);
  for (DType t : {DType::BF16, DType::F16}) {
    for (Trans tb : {Trans::N, Trans::T}) {
      std::vector<float> want(M * N), got(M * N, 5.0f);
      const std::vector<float> Ar = rounded(t, A), Br = rounded(t, B);
      gemm(Trans::N, tb, M, N, K, Ar.data(), Br.data(), want.data(), false);
      const auto Al = to_lp(t, A), Bl = to_lp(t, B);
      gemm(t, Trans::N, tb, M, N, K, Al.data(), Bl.data(), got.data(), false);
      // Both are f32 accumulations of the same exact products, each within the f32 bound; a
      // native low-precision kernel may sum in another order (the widened path is bit-equal).
      const auto ref = ref_gemm(M, N, K, Ar, Br, tb);
      expect_within(got.data(), ref.data(), M * N, dtype_name(t).data());
      expect_agree(got.data(), want.data(), ref, "low precision vs f32 of rounded operands");
      // accumulate adds into C
      std::vector<float> acc(M * N, 1.0f);
      gemm(t, Trans::N, tb, M, N, K, Al.data(), Bl.data(), acc.data(), true);
      const std::vector<float> ones(M * N, 1.0f);
      const auto ref_acc = ref_gemm(M, N, K, Ar, Br, tb, ones.data());
      expect_within(acc.data(), ref_acc.data(), M * N, "accumulate");
    }
  }
  EXPECT_TRUE(gemm_is_native(DType::F32));
}

TEST(GemmPrecision, GroupedFp16MatchesPerGroupGemm) {
  const int64_t G = 3, N = 24, K = 40;
  const int64_t M[G] = {5, 0, 17};
  const std::vector<float> A = moetrain::testing::random_vector(22 * K, 3),
                           B = moetrain::testing::random_vector(G * N * K, 4);
  const auto Al = to_lp(DType::F16, A), Bl = to_lp(DType::F16, B);
  std::vector<float> got(22 * N), want(22 * N);
  grouped_gemm(Trans::T, G, M, N, K, reinterpret_cast<const fp16*>(Al.data()),
               reinterpret_cast<const fp16*>(Bl.data()), N * K, got.data(), false);
  const std::vector<float> Ar = rounded(DType::F16, A), Br = rounded(DType::F16, B);
  grouped_gemm(Trans::T, G, M, N, K, Ar.data(), Br.data(), N * K, want.data(), false);
  // Each group's rows against its own weights; both computations within the f32 bound.
  std::vector<Bounded> ref;
  for (int64_t g = 0, row = 0; g < G; row += M[g], ++g) {
    const std::vector<float> Ag(Ar.begin() + row * K, Ar.begin() + (row + M[g]) * K),
        Bg(Br.begin() + g * N * K, Br.begin() + (g + 1) * N * K);
    const auto part = ref_gemm(M[g], N, K, Ag, Bg, Trans::T);
    ref.insert(ref.end(), part.begin(), part.end());
  }
  expect_agree(got.data(), want.data(), ref, "grouped fp16");
  std::vector<float> dw(G * 6 * 7, 0.0f), dw_want(G * 6 * 7, 0.0f);
  const std::vector<float> X = moetrain::testing::random_vector(22 * 6, 5),
                           Y = moetrain::testing::random_vector(22 * 7, 6);
  const auto Xl = to_lp(DType::F16, X), Yl = to_lp(DType::F16, Y);
  grouped_gemm_reduce(G, M, 6, 7, reinterpret_cast<const fp16*>(Xl.data()),
                      reinterpret_cast<const fp16*>(Yl.data()), dw.data(), 42, true);
  const std::vector<float> Xr = rounded(DType::F16, X), Yr = rounded(DType::F16, Y);
  grouped_gemm_reduce(G, M, 6, 7, Xr.data(), Yr.data(), dw_want.data(), 42, true);
  // dw_g (6, 7) = X_gᵀ Y_g accumulated onto zeros: M_g + 1 terms per element.
  std::vector<Bounded> dw_ref(G * 42);
  for (int64_t g = 0, row = 0; g < G; row += M[g], ++g)
    for (int64_t p = 0; p < 6; ++p)
      for (int64_t q = 0; q < 7; ++q) {
        BoundedSum s;
        s.add(Bounded{0.0});
        for (int64_t m = row; m < row + M[g]; ++m) s.add(Xr[m * 6 + p], Yr[m * 7 + q]);
        dw_ref[g * 42 + p * 7 + q] = s.result();
      }
  expect_within(dw.data(), dw_ref.data(), G * 42, "grouped reduce fp16");
  expect_agree(dw.data(), dw_want.data(), dw_ref, "grouped reduce fp16 vs f32");
}

// A linear layer (out = x·Wᵀ, dx = dout·W, dW = doutᵀ·x) with every operand rounded: within 1%
// (bf16: 8-bit significand) and 0.2% (fp16: 11 bits) of the f32 layer in relative norm.
TEST(GemmPrecision, LinearLayerTracksF32) {
  const int64_t N = 64, IC = 96, OC = 80;
  const std::vector<float> x = moetrain::testing::random_vector(N * IC, 7),
                           w = moetrain::testing::random_vector(OC * IC, 8, 0.1f);
  const std::vector<float> dout = moetrain::testing::random_vector(N * OC, 9);
  std::vector<float> y(N * OC), dx(N * IC), dw(OC * IC, 0.0f);
  linear_forward(y.data(), x.data(), w.data(), N, IC, OC);
  linear_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), N, IC, OC);
  for (DType t : {DType::BF16, DType::F16}) {
    const double tol = t == DType::BF16 ? 1e-2 : 2e-3;
    const auto xl = to_lp(t, x), wl = to_lp(t, w), dl = to_lp(t, dout);
    std::vector<float> yl(N * OC), dxl(N * IC), dwl(OC * IC, 0.0f);
    gemm(t, Trans::N, Trans::T, N, OC, IC, xl.data(), wl.data(), yl.data(), false);
    gemm(t, Trans::N, Trans::N, N, IC, OC, dl.data(), wl.data(), dxl.data(), false);
    gemm(t, Trans::T, Trans::N, OC, IC, N, dl.data(), xl.data(), dwl.data(), true);
    EXPECT_LT(rel_norm_error(yl, y), tol) << dtype_name(t);
    EXPECT_LT(rel_norm_error(dxl, dx), tol) << dtype_name(t);
    EXPECT_LT(rel_norm_error(dwl, dw), tol) << dtype_name(t);
    // ...and not trivially: the rounding is visible.
    EXPECT_GT(rel_norm_error(yl, y), 1e-5) << dtype_name(t);
  }
}
