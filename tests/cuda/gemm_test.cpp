// The device GEMM (src/cuda/gemm.cpp) in each operand mode against the CPU's kernels/gemm on the
// same inputs, and the bf16 rounding of operands (src/cuda/convert.cu) against core/dtype.h's,
// bit for bit. Error bounds: a dot product of K terms summed in any order in f32 is within
// γ_K·Σ|a·b| of the exact one (γ_K = K·u/(1 − K·u), u = 2^-24); two such sums differ by at most
// twice that. bf16 operands multiply exactly in f32 (8-bit significands), so CPU bf16 and GPU
// bf16 obey the same bound; TF32 rounds each operand to 10 bits (relative 2^-11), so its products
// are within about 2^-10 of the f32 ones, plus the summation bound.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cuda/device.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "kernels/gemm.h"
#include "support/device_buffers.h"
#include "support/random_values.h"

namespace {

using namespace moetrain;
using namespace moetrain::testing;

constexpr double kU = 0x1p-24;

std::vector<bf16> rounded(const std::vector<float>& v) {
  std::vector<bf16> r;
  r.reserve(v.size());
  for (float x : v) r.emplace_back(x);
  return r;
}

// Σ_k |A[m,k]|·|B[k,n]| for row-major A (M, K) and B stored (N, K) (Trans::T), in double.
std::vector<double> abs_products(const std::vector<float>& A, const std::vector<float>& B,
                                 int64_t M, int64_t N, int64_t K) {
  std::vector<double> s(static_cast<std::size_t>(M * N), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        s[m * N + n] += std::abs(double(A[m * K + k])) * std::abs(double(B[n * K + k]));
  return s;
}

double gamma(int64_t K) {
  return K * kU / (1 - K * kU);
}

TEST(CudaConvert, RoundsToBf16AsTheCpuBitForBit) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << why;
  std::vector<float> v = normal(4099, 11);
  // Ties in both directions, NaN, ±Inf, values that round up to Inf, subnormals, signed zeros.
  for (uint32_t bits : {0x3f808000u, 0x3f818000u, 0x7fc00001u, 0xff800001u, 0x7f800000u,
                        0xff800000u, 0x7f7fffffu, 0x00000001u, 0x807fffffu, 0x80000000u, 0u})
    v.push_back(std::bit_cast<float>(bits));
  cuda::Context ctx;
  const cuda::DeviceBuffer<float> in = to_device(v);
  // Every alignment of the input and the output: the vectorised and the scalar paths.
  for (int64_t off : {0, 1, 2, 3}) {
    const int64_t n = static_cast<int64_t>(v.size()) - off;
    cuda::DeviceBuffer<uint16_t> out(n + 1);
    uploads_done();
    cuda::to_bf16(out.data() + (off & 1), in.data() + off, n, ctx.stream());
    ctx.sync();
    const std::vector<uint16_t> got = to_host(out);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(got[i + (off & 1)], bf16(v[i + off]).bits)
          << "element " << i + off << " (" << v[i + off] << "), offset " << off;
  }
}

// C = A·Bᵀ (a linear layer's forward), with A (M, K) and B (N, K), on the device in `mode` and on
// the CPU in f32 or bf16: the largest difference in units of the element's bound.
struct Case {
  int64_t M, N, K;
};

class CudaGemmTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaGemmTest, EachModeWithinItsBoundOfTheCpu) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << why;
  const auto [M, N, K] = GetParam();
  const std::vector<float> A = normal(M * K, 1), B = normal(N * K, 2);
  std::vector<float> c32(static_cast<std::size_t>(M * N)), cbf(c32.size());
  gemm(Trans::N, Trans::T, M, N, K, A.data(), B.data(), c32.data(), false);
  const std::vector<bf16> Ab = rounded(A), Bb = rounded(B);
  gemm(Trans::N, Trans::T, M, N, K, Ab.data(), Bb.data(), cbf.data(), false);
  const std::vector<double> mag = abs_products(A, B, M, N, K);

  cuda::Context ctx;
  const cuda::DeviceBuffer<float> dA = to_device(A), dB = to_device(B);
  cuda::DeviceBuffer<float> dC(M * N);
  auto run = [&](DeviceGemm mode, bool exact) {
    ctx.set_gemm_mode(mode);
    uploads_done();
    cuda::gemm(ctx, Trans::N, Trans::T, M, N, K, dA.data(), dB.data(), dC.data(), false, exact);
    ctx.sync();
    return to_host(dC);
  };
  // Largest |got − ref| / bound over the elements (≤ 1 passes), and the largest |got − ref|.
  auto worst = [&](const std::vector<float>& got, const std::vector<float>& ref, double rel) {
    double w = 0, d = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double diff = std::abs(double(got[i]) - double(ref[i]));
      w = std::max(w, diff / (rel * mag[i] + 1e-30));
      d = std::max(d, diff);
    }
    return std::pair{w, d};
  };
  const double sum_bound = 2 * gamma(K);
  EXPECT_LE(worst(run(DeviceGemm::F32, false), c32, sum_bound).first, 1.0) << "f32";
  EXPECT_LE(worst(run(DeviceGemm::BF16, true), c32, sum_bound).first, 1.0) << "exact in bf16 mode";
  EXPECT_LE(worst(run(DeviceGemm::TF32, true), c32, sum_bound).first, 1.0) << "exact in tf32 mode";
  const auto bf = worst(run(DeviceGemm::BF16, false), cbf, sum_bound);
  EXPECT_LE(bf.first, 1.0) << "bf16 against the CPU's bf16";
  // Products of two operands rounded to TF32's 11 significant bits: (1 + 2^-11)² − 1.
  const auto tf = worst(run(DeviceGemm::TF32, false), c32, 2 * 0x1p-11 + 0x1p-22 + sum_bound);
  EXPECT_LE(tf.first, 1.0) << "tf32 against the CPU's f32";
  // Tiny products may run on kernels without tensor cores; large ones show TF32's rounding.
  if (M * N * K >= 64 * 64 * 64) {
    EXPECT_GT(tf.second, 0.0) << "tf32 rounds its operands: the product cannot be f32's";
  }
  EXPECT_GT(worst(run(DeviceGemm::BF16, false), c32, 1.0).second, 0.0)
      << "bf16 rounds its operands: the product cannot be f32's";
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaGemmTest,
                         ::testing::Values(Case{1, 1, 1}, Case{7, 5, 3}, Case{64, 48, 96},
                                           Case{130, 257, 513}));

// In bf16 mode a weight inside the registered copy is read from the copy, not rounded again: a
// copy that differs from the weights shows in the product.
TEST(CudaGemm, Bf16ReadsWeightsFromTheCopy) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << why;
  const int64_t M = 16, N = 24, K = 32;
  const std::vector<float> A = normal(M * K, 3), W = normal(N * K, 4);
  std::vector<float> doubled(W.size());
  for (std::size_t i = 0; i < W.size(); ++i) doubled[i] = 2 * W[i];
  std::vector<uint16_t> copy_bits;
  for (float x : doubled) copy_bits.push_back(bf16(x).bits);
  cuda::Context ctx;
  const cuda::DeviceBuffer<float> dA = to_device(A), dW = to_device(W);
  const cuda::DeviceBuffer<uint16_t> copy = to_device(copy_bits);
  cuda::DeviceBuffer<float> dC(M * N);
  ctx.set_gemm_mode(DeviceGemm::BF16);
  ctx.set_weight_copy(dW.data(), N * K, copy.data());
  uploads_done();
  cuda::linear_forward(ctx, dC.data(), dA.data(), dW.data(), M, K, N);
  ctx.sync();
  const std::vector<float> got = to_host(dC);
  std::vector<float> ref(got.size());
  const std::vector<bf16> Ab = rounded(A), Db = rounded(doubled);
  gemm(Trans::N, Trans::T, M, N, K, Ab.data(), Db.data(), ref.data(), false);
  const std::vector<double> mag = abs_products(A, doubled, M, N, K);
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::abs(double(got[i]) - ref[i]), 2 * gamma(K) * mag[i] + 1e-30) << "element " << i;
}

// An activation inside a live Bf16Operand is read from the copy made when the scope began: a
// change to the f32 array after that does not show in the product until the scope ends.
TEST(CudaGemm, Bf16ReadsAnActivationFromItsOperandCopy) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << why;
  const int64_t M = 16, N = 24, K = 32;
  const std::vector<float> A = normal(M * K, 5), W = normal(N * K, 6), A2 = normal(M * K, 7);
  cuda::Context ctx;
  cuda::DeviceBuffer<float> dA = to_device(A);
  const cuda::DeviceBuffer<float> dW = to_device(W), dA2 = to_device(A2);
  cuda::DeviceBuffer<float> dC(M * N), dC2(M * N);
  ctx.set_gemm_mode(DeviceGemm::BF16);
  uploads_done();
  {
    const cuda::Bf16Operand copy(ctx, dA.data(), M * K);
    MOETRAIN_CUDA_CHECK(cudaMemcpyAsync(dA.data(), dA2.data(), sizeof(float) * M * K,
                                        cudaMemcpyDeviceToDevice, ctx.stream()));
    cuda::linear_forward(ctx, dC.data(), dA.data(), dW.data(), M, K, N);  // the copy: A
  }
  cuda::linear_forward(ctx, dC2.data(), dA.data(), dW.data(), M, K, N);  // rounded afresh: A2
  ctx.sync();
  const std::vector<bf16> Wb = rounded(W);
  for (const auto& [got, src] : {std::pair{to_host(dC), &A}, std::pair{to_host(dC2), &A2}}) {
    std::vector<float> ref(got.size());
    const std::vector<bf16> Ab = rounded(*src);
    gemm(Trans::N, Trans::T, M, N, K, Ab.data(), Wb.data(), ref.data(), false);
    const std::vector<double> mag = abs_products(*src, W, M, N, K);
    for (std::size_t i = 0; i < got.size(); ++i)
      ASSERT_LE(std::abs(double(got[i]) - ref[i]), 2 * gamma(K) * mag[i] + 1e-30)
          << "element " << i << (src == &A ? " (inside the scope)" : " (after it)");
  }
}

}  // namespace
