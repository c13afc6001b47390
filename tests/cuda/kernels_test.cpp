// The device kernels of src/cuda/{embedding,norm,rope,activation,softmax}.cu against the CPU
// kernels of the same names (src/kernels) on the same random inputs, forward and backward: bitwise
// where both sides perform the same uncontracted float operations in the same order, elsewhere
// within an error bound derived (and stated) per kernel; plus `+=` gradients that accumulate onto
// a non-zero buffer, in-place calls, zero sizes and run-to-run bitwise repeatability.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/kernels.h"
#include "kernels/activation.h"
#include "kernels/embedding.h"
#include "kernels/norm.h"
#include "kernels/rope.h"
#include "kernels/softmax.h"
#include "support/device_buffers.h"
#include "support/random_values.h"

namespace {

using namespace moetrain::testing;

using moetrain::cuda::Context;
using moetrain::cuda::DeviceBuffer;

// Unit roundoff of float: every correctly rounded float operation has relative error ≤ u.
constexpr double kU = 0x1p-24;
// Results that underflow may differ by up to the smallest normal float.
constexpr double kTiny = 0x1p-126;

// Every |got_i − want_i| ≤ bound_i (a NaN fails); reports the worst element relative to its bound.
void expect_within(const std::vector<float>& got, const std::vector<float>& want,
                   const std::vector<double>& bound, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_EQ(got.size(), bound.size()) << what;
  double worst = 0;
  int64_t at = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double(got[i]) - double(want[i]));
    const double ratio = err == 0 ? 0 : err / bound[i];
    if (!(ratio <= worst)) worst = ratio, at = static_cast<int64_t>(i);
  }
  if (at < 0) return;
  EXPECT_LE(worst, 1.0) << what << ": element " << at << " is " << got[at] << " on the device, "
                        << want[at] << " on the CPU, bound " << bound[at];
}

int64_t count_different_bits(const std::vector<float>& a, const std::vector<float>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i)
    n += std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i]);
  return n;
}

// ---------------------------------------------------------------------------------------------
// Embedding: a copy forward, and a backward whose additions (each table row adds its tokens'
// rows one at a time in token order) are the CPU's exactly: bitwise equality throughout.

struct EmbeddingShape {
  int64_t N, C, V;
};

class CudaEmbeddingTest : public ::testing::TestWithParam<EmbeddingShape> {};

TEST_P(CudaEmbeddingTest, MatchesCpuBitwiseAccumulatesAndRepeats) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  const auto [N, C, V] = GetParam();
  // Every third token is id 0, so one row gathers many tokens, across the kernel's chunks of ids.
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> id_dist(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> ids(N);
  for (int64_t n = 0; n < N; ++n) ids[n] = n % 3 == 0 ? 0 : id_dist(rng);
  const auto table = normal(V * C, 12), dout = normal(N * C, 13);
  const auto dtable0 = normal(V * C, 14);  // non-zero: the backward must add onto it

  std::vector<float> out_cpu(N * C), dtable_cpu = dtable0;
  moetrain::embedding_forward(out_cpu.data(), ids.data(), table.data(), N, C, V);
  moetrain::embedding_backward(dtable_cpu.data(), dout.data(), ids.data(), N, C, V);

  Context ctx;
  auto d_ids = to_device(ids);
  auto d_table = to_device(table), d_dout = to_device(dout), d_dtable = to_device(dtable0);
  DeviceBuffer<float> d_out(N * C);
  uploads_done();
  moetrain::cuda::embedding_forward(d_out.data(), d_ids.data(), d_table.data(), N, C, V,
                                    ctx.stream());
  moetrain::cuda::embedding_backward(d_dtable.data(), d_dout.data(), d_ids.data(), N, C, V,
                                     ctx.stream());
  ctx.sync();
  const auto out = to_host(d_out), dtable = to_host(d_dtable);
  expect_same_bits(out, out_cpu, "embedding out");
  expect_same_bits(dtable, dtable_cpu, "embedding dtable");

  // A second backward adds again: bitwise the CPU's second call.
  moetrain::embedding_backward(dtable_cpu.data(), dout.data(), ids.data(), N, C, V);
  moetrain::cuda::embedding_backward(d_dtable.data(), d_dout.data(), d_ids.data(), N, C, V,
                                     ctx.stream());
  ctx.sync();
  expect_same_bits(to_host(d_dtable), dtable_cpu, "embedding dtable after two backwards");

  // Repeated from the same start: the same bits.
  d_dtable.upload(dtable0.data(), V * C);
  uploads_done();
  moetrain::cuda::embedding_backward(d_dtable.data(), d_dout.data(), d_ids.data(), N, C, V,
                                     ctx.stream());
  ctx.sync();
  expect_same_bits(to_host(d_dtable), dtable, "embedding dtable, repeated");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaEmbeddingTest,
                         ::testing::Values(EmbeddingShape{1, 1, 1}, EmbeddingShape{1, 7, 3},
                                           EmbeddingShape{5, 33, 4}, EmbeddingShape{300, 31, 7},
                                           EmbeddingShape{1000, 257, 50},
                                           EmbeddingShape{2500, 65, 300},
                                           EmbeddingShape{4096, 768, 1000}));

// The device cannot throw: an id outside [0, V) gives a NaN row forward and is skipped backward.
TEST(CudaEmbedding, BadIdGivesNanRowAndIsSkippedBackward) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  const int64_t N = 3, C = 5, V = 4;
  const std::vector<int32_t> ids = {1, 4, -1};
  const auto table = normal(V * C, 15), dout = normal(N * C, 16), dtable0 = normal(V * C, 17);
  Context ctx;
  auto d_ids = to_device(ids);
  auto d_table = to_device(table), d_dout = to_device(dout), d_dtable = to_device(dtable0);
  DeviceBuffer<float> d_out(N * C);
  uploads_done();
  moetrain::cuda::embedding_forward(d_out.data(), d_ids.data(), d_table.data(), N, C, V,
                                    ctx.stream());
  moetrain::cuda::embedding_backward(d_dtable.data(), d_dout.data(), d_ids.data(), N, C, V,
                                     ctx.stream());
  ctx.sync();
  const auto out = to_host(d_out), dtable = to_host(d_dtable);
  for (int64_t c = 0; c < C; ++c) {
    EXPECT_EQ(std::bit_cast<uint32_t>(out[c]), std::bit_cast<uint32_t>(table[1 * C + c]));
    EXPECT_TRUE(std::isnan(out[1 * C + c]));
    EXPECT_TRUE(std::isnan(out[2 * C + c]));
  }
  // Only token 0 (id 1) lands in the table.
  std::vector<float> want = dtable0;
  for (int64_t c = 0; c < C; ++c) want[1 * C + c] += dout[c];
  expect_same_bits(dtable, want, "embedding dtable with bad ids");
}

// ---------------------------------------------------------------------------------------------
// RMSNorm. The row sums are in double on both sides (a block reduction on the device, eight
// interleaved partial sums on the CPU): they differ by ~C·2^-53 relative, so rstd (their float
// rounding) is the CPU's or one ulp (≤ 2u·|r|) away. Everything after the sums is the same
// uncontracted float arithmetic.

struct NormShape {
  int64_t N, C;
};

class CudaRmsNormTest : public ::testing::TestWithParam<NormShape> {};

constexpr float kNormEps = 1e-5f;

TEST_P(CudaRmsNormTest, ForwardMatchesCpu) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  const auto [N, C] = GetParam();
  const auto x = normal(N * C, 21, 2.0f), w = normal(C, 22, 0.1f, 1.0f);
  std::vector<float> out_cpu(N * C), rstd_cpu(N);
  moetrain::rmsnorm_forward(out_cpu.data(), rstd_cpu.data(), x.data(), w.data(), N, C, kNormEps);

  Context ctx;
  auto d_x = to_device(x), d_w = to_device(w);
  DeviceBuffer<float> d_out(N * C), d_rstd(N), d_rstd2(N);
  uploads_done();
  moetrain::cuda::rmsnorm_forward(d_out.data(), d_rstd.data(), d_x.data(), d_w.data(), N, C,
                                  kNormEps, ctx.stream());
  ctx.sync();
  const auto out = to_host(d_out), rstd = to_host(d_rstd);

  // rstd: one ulp, ≤ 2u·|r|.
  std::vector<double> rstd_bound(N);
  for (int64_t n = 0; n < N; ++n) rstd_bound[n] = 2 * kU * std::abs(double(rstd_cpu[n]));
  expect_within(rstd, rstd_cpu, rstd_bound, "rmsnorm rstd");
  // out = w·(x·r): bitwise on rows whose rstd is bitwise the CPU's; on the others r carries 2u and
  // each of the two products up to u more per side, so ≤ 8u·|out| covers the difference.
  std::vector<double> out_bound(N * C);
  for (int64_t i = 0; i < N * C; ++i) out_bound[i] = 8 * kU * std::abs(double(out_cpu[i])) + kTiny;
  expect_within(out, out_cpu, out_bound, "rmsnorm out");
  for (int64_t n = 0; n < N; ++n) {
    if (std::bit_cast<uint32_t>(rstd[n]) != std::bit_cast<uint32_t>(rstd_cpu[n])) continue;
    const std::vector<float> row(out.begin() + n * C, out.begin() + (n + 1) * C);
    const std::vector<float> row_cpu(out_cpu.begin() + n * C, out_cpu.begin() + (n + 1) * C);
    expect_same_bits(row, row_cpu, "rmsnorm out of a row with the CPU's rstd");
  }

  // In place (out = inp) and repeated: the same bits.
  auto d_inplace = to_device(x);
  uploads_done();
  moetrain::cuda::rmsnorm_forward(d_inplace.data(), d_rstd2.data(), d_inplace.data(), d_w.data(), N,
                                  C, kNormEps, ctx.stream());
  ctx.sync();
  expect_same_bits(to_host(d_inplace), out, "rmsnorm out in place");
  expect_same_bits(to_host(d_rstd2), rstd, "rmsnorm rstd, repeated");
}

TEST_P(CudaRmsNormTest, BackwardMatchesCpuAccumulatesAndRepeats) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  const auto [N, C] = GetParam();
  const auto x = normal(N * C, 23, 2.0f), w = normal(C, 24, 0.1f, 1.0f), dy = normal(N * C, 25);
  const auto dweight0 = normal(C, 26);  // non-zero: the backward must add onto it
  // Both sides take the CPU's rstd, so that only the backward's own sums differ.
  std::vector<float> out_cpu(N * C), rstd(N);
  moetrain::rmsnorm_forward(out_cpu.data(), rstd.data(), x.data(), w.data(), N, C, kNormEps);
  std::vector<float> dinp_cpu(N * C), dweight_cpu = dweight0;
  moetrain::rmsnorm_backward(dinp_cpu.data(), dweight_cpu.data(), dy.data(), x.data(), w.data(),
                             rstd.data(), N, C);

  Context ctx;
  auto d_x = to_device(x), d_w = to_device(w), d_dy = to_device(dy), d_rstd = to_device(rstd);
  auto d_dweight = to_device(dweight0);
  DeviceBuffer<float> d_dinp(N * C);
  uploads_done();
  moetrain::cuda::rmsnorm_backward(d_dinp.data(), d_dweight.data(), d_dy.data(), d_x.data(),
                                   d_w.data(), d_rstd.data(), N, C, ctx.stream());
  ctx.sync();
  const auto dinp = to_host(d_dinp), dweight = to_host(d_dweight);

  // dweight: the CPU's double operations in the CPU's row order: bitwise.
  expect_same_bits(dweight, dweight_cpu, "rmsnorm dweight");
  // dinp = fl(fl(fl(r·w)·dy) − fl(k·x)) with k = float(r³·Σ dy·w·x / C): the first product is the
  // CPU's bits; k is the CPU's or one ulp (2u·|k|) away, which moves fl(k·x) by ≤ 2u·|k·x| plus a
  // rounding of u per side, and the difference rounds by u·|dx| per side:
  // |Δ| ≤ 6u·(|r·w·dy| + |k·x|); the bound takes 8u.
  std::vector<double> bound(N * C);
  for (int64_t n = 0; n < N; ++n) {
    const double r = rstd[n];
    double dot = 0;
    for (int64_t c = 0; c < C; ++c) dot += double(dy[n * C + c]) * w[c] * x[n * C + c];
    const double k = r * r * r * dot / double(C);
    for (int64_t c = 0; c < C; ++c) {
      const int64_t i = n * C + c;
      bound[i] = 8 * kU * (std::abs(r * double(w[c]) * dy[i]) + std::abs(k * x[i])) + kTiny;
    }
  }
  expect_within(dinp, dinp_cpu, bound, "rmsnorm dinp");

  // A second backward adds onto dweight again: bitwise the CPU's second call; dinp is overwritten
  // with the same bits.
  moetrain::rmsnorm_backward(dinp_cpu.data(), dweight_cpu.data(), dy.data(), x.data(), w.data(),
                             rstd.data(), N, C);
  moetrain::cuda::rmsnorm_backward(d_dinp.data(), d_dweight.data(), d_dy.data(), d_x.data(),
                                   d_w.data(), d_rstd.data(), N, C, ctx.stream());
  ctx.sync();
  expect_same_bits(to_host(d_dweight), dweight_cpu, "rmsnorm dweight after two backwards");
  expect_same_bits(to_host(d_dinp), dinp, "rmsnorm dinp, repeated");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaRmsNormTest,
                         ::testing::Values(NormShape{1, 1}, NormShape{1, 31}, NormShape{3, 33},
                                           NormShape{7, 257}, NormShape{300, 1000},
                                           NormShape{512, 2048}));

// ---------------------------------------------------------------------------------------------
// RoPE. inv_freq is bitwise the CPU's (the launcher computes it with the CPU's expression) and so
// is the float angle; cos/sin are float roundings of double cos/sin, CUDA's within 2 double ulp,
// so each is the CPU's float or one float ulp (≤ 2u) away. Then y = fl(fl(x1·c) ∓ fl(x2·s))
// moves by ≤ 2u·(|x1| + |x2|) from c and s, u·(|x1| + |x2|) per side from the products and
// u·|y| ≤ u·(|x1| + |x2|) per side from the sum: |Δ| ≤ 6u·(|x1| + |x2|); the bound takes 8u.

struct RopeShape {
  int64_t N, NH, HS;
  float theta;
};

class CudaRopeTest : public ::testing::TestWithParam<RopeShape> {};

std::vector<int32_t> rope_positions(int64_t N) {
  std::mt19937 rng(31);
  std::uniform_int_distribution<int32_t> dist(0, 4999);
  std::vector<int32_t> pos(N);
  for (int32_t& p : pos) p = dist(rng);
  if (N > 0) pos[0] = 0;
  if (N > 2) pos[2] = 131071;  // long context: the float angle's rounding matters there
  return pos;
}

// |Δ| ≤ 8u·(|x_i| + |x_partner|) for both halves of every pair.
std::vector<double> rope_bound(const std::vector<float>& x, int64_t N, int64_t NH, int64_t HS) {
  const int64_t half = HS / 2;
  std::vector<double> bound(N * NH * HS);
  for (int64_t b = 0; b < N * NH * HS; b += HS) {
    for (int64_t i = 0; i < half; ++i) {
      const double mag = std::abs(double(x[b + i])) + std::abs(double(x[b + i + half]));
      bound[b + i] = bound[b + i + half] = 8 * kU * mag + kTiny;
    }
  }
  return bound;
}

TEST_P(CudaRopeTest, ForwardAndBackwardMatchCpu) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  const auto [N, NH, HS, theta] = GetParam();
  const int64_t n_all = N * NH * HS;
  const auto pos = rope_positions(N);
  const auto x = normal(n_all, 32), dy = normal(n_all, 33);
  std::vector<float> out_cpu(n_all), dinp_cpu(n_all);
  moetrain::rope_forward(out_cpu.data(), x.data(), pos.data(), N, NH, HS, theta);
  moetrain::rope_backward(dinp_cpu.data(), dy.data(), pos.data(), N, NH, HS, theta);

  Context ctx;
  auto d_pos = to_device(pos);
  auto d_x = to_device(x), d_dy = to_device(dy);
  DeviceBuffer<float> d_out(n_all), d_dinp(n_all);
  uploads_done();
  moetrain::cuda::rope_forward(d_out.data(), d_x.data(), d_pos.data(), N, NH, HS, theta,
                               ctx.stream());
  moetrain::cuda::rope_backward(d_dinp.data(), d_dy.data(), d_pos.data(), N, NH, HS, theta,
                                ctx.stream());
  ctx.sync();
  const auto out = to_host(d_out), dinp = to_host(d_dinp);
  expect_within(out, out_cpu, rope_bound(x, N, NH, HS), "rope out");
  expect_within(dinp, dinp_cpu, rope_bound(dy, N, NH, HS), "rope dinp");
  // A float cos/sin differs from the CPU's only when CUDA's double result straddles a float
  // rounding boundary (odds ~2^-28 per value): all but a few elements must be the CPU's bits.
  EXPECT_LE(count_different_bits(out, out_cpu), n_all / 100) << "rope out";
  EXPECT_LE(count_different_bits(dinp, dinp_cpu), n_all / 100) << "rope dinp";

  // In place (out = inp, dinp = dout) and repeated: the same bits.
  auto d_inplace = to_device(x), d_inplace_back = to_device(dy);
  uploads_done();
  moetrain::cuda::rope_forward(d_inplace.data(), d_inplace.data(), d_pos.data(), N, NH, HS, theta,
                               ctx.stream());
  moetrain::cuda::rope_backward(d_inplace_back.data(), d_inplace_back.data(), d_pos.data(), N, NH,
                                HS, theta, ctx.stream());
  ctx.sync();
  expect_same_bits(to_host(d_inplace), out, "rope out in place");
  expect_same_bits(to_host(d_inplace_back), dinp, "rope dinp in place");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaRopeTest,
    ::testing::Values(RopeShape{1, 1, 2, 10000.0f}, RopeShape{3, 2, 6, 10000.0f},
                      RopeShape{5, 3, 34, 10000.0f}, RopeShape{64, 4, 64, 1e6f},
                      RopeShape{257, 8, 128, 10000.0f}, RopeShape{1024, 8, 128, 500000.0f}));

// ---------------------------------------------------------------------------------------------
// SwiGLU and add. σ(a) = 1/(1 + exp(−a)) with expf on both sides: CUDA's within 2 ulp, glibc's
// within 1, so exp(−a) differs by ≤ 3 ulp ≤ 6u relative; it enters σ scaled by e/(1 + e) ≤ 1, and
// the sum and the division add 2u per side: σ differs by ≤ 10u relative.
//   out = (a·σ)·b, db = g·(a·σ): two more roundings per side, ≤ 14u; the bound takes
//     16u·|a·σ·b| (resp. 16u·|g·a·σ|), magnitudes from the exact σ.
//   da = g·b·σ·(1 + a·(1 − σ)): 1 − σ is exact (Sterbenz) but carries σ's error absolutely
//     (≤ 10u), which a multiplies; the bound takes 32u·|g·b·σ|·(1 + 2|a|), about twice the sum
//     of the terms' error bounds (nvcc may also fuse 1 + a·(1 − σ) into an FMA, which only helps).

class CudaActivationTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(CudaActivationTest, SwigluMatchesCpuAndRepeats) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  const int64_t n = GetParam();
  auto a = normal(n, 41, 3.0f);
  const auto b = normal(n, 42), g = normal(n, 43);
  // Saturated and signed-zero inputs: exp(−a) overflows to inf (σ = 0) or goes to 0 (σ = 1).
  const std::vector<float> special = {0.0f, -0.0f, 100.0f, -100.0f, 20.0f, -20.0f, 1e-30f};
  for (size_t i = 0; i < special.size() && i < a.size(); ++i) a[i] = special[i];

  std::vector<float> out_cpu(n), da_cpu(n), db_cpu(n);
  moetrain::swiglu_forward(out_cpu.data(), a.data(), b.data(), n);
  moetrain::swiglu_backward(da_cpu.data(), db_cpu.data(), g.data(), a.data(), b.data(), n);

  Context ctx;
  auto d_a = to_device(a), d_b = to_device(b), d_g = to_device(g);
  DeviceBuffer<float> d_out(n), d_da(n), d_db(n);
  uploads_done();
  moetrain::cuda::swiglu_forward(d_out.data(), d_a.data(), d_b.data(), n, ctx.stream());
  moetrain::cuda::swiglu_backward(d_da.data(), d_db.data(), d_g.data(), d_a.data(), d_b.data(), n,
                                  ctx.stream());
  ctx.sync();
  const auto out = to_host(d_out), da = to_host(d_da), db = to_host(d_db);

  std::vector<double> out_bound(n), da_bound(n), db_bound(n);
  for (int64_t i = 0; i < n; ++i) {
    const double s = 1.0 / (1.0 + std::exp(-double(a[i])));
    const double ai = a[i], bi = b[i], gi = g[i];
    out_bound[i] = 16 * kU * std::abs(ai * s * bi) + kTiny;
    db_bound[i] = 16 * kU * std::abs(gi * ai * s) + kTiny;
    da_bound[i] = 32 * kU * std::abs(gi * bi * s) * (1 + 2 * std::abs(ai)) + kTiny;
  }
  expect_within(out, out_cpu, out_bound, "swiglu out");
  expect_within(da, da_cpu, da_bound, "swiglu da");
  expect_within(db, db_cpu, db_bound, "swiglu db");

  // Repeated: the same bits.
  moetrain::cuda::swiglu_forward(d_out.data(), d_a.data(), d_b.data(), n, ctx.stream());
  moetrain::cuda::swiglu_backward(d_da.data(), d_db.data(), d_g.data(), d_a.data(), d_b.data(), n,
                                  ctx.stream());
  ctx.sync();
  expect_same_bits(to_host(d_out), out, "swiglu out, repeated");
  expect_same_bits(to_host(d_da), da, "swiglu da, repeated");
  expect_same_bits(to_host(d_db), db, "swiglu db, repeated");

  // The bf16 outputs for bf16 GEMMs: bf16 of the f32 results, bit for bit (core/dtype.h); the
  // backward then leaves da and db unwritten.
  DeviceBuffer<uint16_t> d_out16(n), d_da16(n), d_db16(n);
  DeviceBuffer<float> d_da2(n), d_db2(n);
  MOETRAIN_CUDA_CHECK(cudaMemsetAsync(d_da2.data(), 0xff, sizeof(float) * n, ctx.stream()));
  MOETRAIN_CUDA_CHECK(cudaMemsetAsync(d_db2.data(), 0xff, sizeof(float) * n, ctx.stream()));
  moetrain::cuda::swiglu_forward(d_out.data(), d_a.data(), d_b.data(), n, ctx.stream(),
                                 d_out16.data());
  moetrain::cuda::swiglu_backward(d_da2.data(), d_db2.data(), d_g.data(), d_a.data(), d_b.data(), n,
                                  ctx.stream(), d_da16.data(), d_db16.data());
  ctx.sync();
  expect_same_bits(to_host(d_out), out, "swiglu out with its bf16 copy");
  const std::vector<uint16_t> out16 = to_host(d_out16), da16 = to_host(d_da16),
                              db16 = to_host(d_db16);
  const std::vector<float> da2 = to_host(d_da2), db2 = to_host(d_db2);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(out16[i], moetrain::bf16(out[i]).bits) << "out16 element " << i;
    ASSERT_EQ(da16[i], moetrain::bf16(da[i]).bits) << "da16 element " << i;
    ASSERT_EQ(db16[i], moetrain::bf16(db[i]).bits) << "db16 element " << i;
    ASSERT_TRUE(std::isnan(da2[i]) && std::isnan(db2[i])) << "da, db written at " << i;
  }
}

// add is one correctly rounded float addition per element: bitwise, also in place.
TEST_P(CudaActivationTest, AddIsBitwiseAlsoInPlace) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  const int64_t n = GetParam();
  const auto a = normal(n, 44), b = normal(n, 45, 1e-3f);
  std::vector<float> want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = a[i] + b[i];

  Context ctx;
  auto d_a = to_device(a), d_b = to_device(b);
  DeviceBuffer<float> d_out(n);
  uploads_done();
  moetrain::cuda::add(d_out.data(), d_a.data(), d_b.data(), n, ctx.stream());
  ctx.sync();
  expect_same_bits(to_host(d_out), want, "add");
  moetrain::cuda::add(d_a.data(), d_a.data(), d_b.data(), n, ctx.stream());    // out = a
  moetrain::cuda::add(d_b.data(), d_out.data(), d_b.data(), n, ctx.stream());  // out = b
  ctx.sync();
  expect_same_bits(to_host(d_a), want, "add in place of a");
  std::vector<float> want_b(n);
  for (int64_t i = 0; i < n; ++i) want_b[i] = want[i] + b[i];
  expect_same_bits(to_host(d_b), want_b, "add in place of b");
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaActivationTest,
                         ::testing::Values(int64_t{1}, int64_t{31}, int64_t{1000},
                                           int64_t{1} << 20));

// ---------------------------------------------------------------------------------------------
// Softmax cross-entropy. The row max is exact on both sides; each term exp(x − m) is a float
// expf (CUDA ≤ 2 ulp = 4u, glibc ≤ 1 ulp) summed in double, so the sums differ by ≤ 5u relative
// and the double lse l by ≤ 5u absolute (plus C·2^-53 of double sums, negligible).
//   lse = float(l): one rounding per side, ≤ ulp(lse) ≤ 2u·|lse| together: |Δ| ≤ 5u + 2u·|lse|;
//   loss = float(l − x_t): likewise |Δ| ≤ 5u + 2u·|loss|. Both bounds take 8u·(1 + |value|).
// The backward takes the CPU's lse on both sides: dx = fl(g·expf(x − lse)) [− g at the target]:
// the exp differs by ≤ 5u relative, the product and the subtraction round once more per side:
// |Δ| ≤ 7u·(|g·p| + |dx|); the bound takes 8u, with p = exp(x − lse) in double.

struct XentShape {
  int64_t N, V;
};

class CudaSoftmaxXentTest : public ::testing::TestWithParam<XentShape> {};

// Every fourth row ignored (−1), starting with row 3; the others a target spread over [0, V).
std::vector<int32_t> xent_targets(int64_t N, int64_t V) {
  std::mt19937 rng(51);
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> t(N);
  for (int64_t n = 0; n < N; ++n) t[n] = n % 4 == 3 ? -1 : dist(rng);
  return t;
}

TEST_P(CudaSoftmaxXentTest, ForwardAndBackwardMatchCpuAndRepeat) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  const auto [N, V] = GetParam();
  auto logits = normal(N * V, 52, 3.0f);
  // A row far from 0: the max subtraction must keep it finite and accurate.
  if (N > 1) {
    for (int64_t v = 0; v < V; ++v) logits[1 * V + v] += 1000.0f;
  }
  const auto targets = xent_targets(N, V);
  const auto dlosses = normal(N, 53);

  std::vector<float> losses_cpu(N), lse_cpu(N), dlogits_cpu(N * V);
  moetrain::softmax_xent_forward(losses_cpu.data(), lse_cpu.data(), logits.data(), targets.data(),
                                 N, V);
  moetrain::softmax_xent_backward(dlogits_cpu.data(), dlosses.data(), logits.data(), lse_cpu.data(),
                                  targets.data(), N, V);

  Context ctx;
  auto d_logits = to_device(logits), d_dlosses = to_device(dlosses), d_lse_cpu = to_device(lse_cpu);
  auto d_targets = to_device(targets);
  DeviceBuffer<float> d_losses(N), d_lse(N), d_dlogits(N * V);
  uploads_done();
  moetrain::cuda::softmax_xent_forward(d_losses.data(), d_lse.data(), d_logits.data(),
                                       d_targets.data(), N, V, ctx.stream());
  moetrain::cuda::softmax_xent_backward(d_dlogits.data(), d_dlosses.data(), d_logits.data(),
                                        d_lse_cpu.data(), d_targets.data(), N, V, ctx.stream());
  ctx.sync();
  const auto losses = to_host(d_losses), lse = to_host(d_lse), dlogits = to_host(d_dlogits);

  std::vector<double> lse_bound(N), loss_bound(N);
  for (int64_t n = 0; n < N; ++n) {
    lse_bound[n] = 8 * kU * (1 + std::abs(double(lse_cpu[n])));
    loss_bound[n] = 8 * kU * (1 + std::abs(double(losses_cpu[n])));
  }
  expect_within(lse, lse_cpu, lse_bound, "softmax_xent lse");
  expect_within(losses, losses_cpu, loss_bound, "softmax_xent losses");
  std::vector<double> dlogits_bound(N * V);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t v = 0; v < V; ++v) {
      const int64_t i = n * V + v;
      const double p = std::exp(double(logits[i]) - double(lse_cpu[n]));
      dlogits_bound[i] =
          8 * kU * (std::abs(double(dlosses[n]) * p) + std::abs(double(dlogits_cpu[i]))) + kTiny;
    }
  }
  expect_within(dlogits, dlogits_cpu, dlogits_bound, "softmax_xent dlogits");
  // Ignored rows: loss and gradient exactly 0.
  for (int64_t n = 3; n < N; n += 4) {
    EXPECT_EQ(std::bit_cast<uint32_t>(losses[n]), 0u) << "row " << n;
    for (int64_t v = 0; v < V; ++v) {
      ASSERT_EQ(std::bit_cast<uint32_t>(dlogits[n * V + v]), 0u) << "row " << n << " col " << v;
    }
  }

  // Repeated, and the backward in place (dlogits = logits): the same bits.
  auto d_inplace = to_device(logits);
  DeviceBuffer<float> d_losses2(N), d_lse2(N);
  uploads_done();
  moetrain::cuda::softmax_xent_forward(d_losses2.data(), d_lse2.data(), d_logits.data(),
                                       d_targets.data(), N, V, ctx.stream());
  moetrain::cuda::softmax_xent_backward(d_inplace.data(), d_dlosses.data(), d_inplace.data(),
                                        d_lse_cpu.data(), d_targets.data(), N, V, ctx.stream());
  ctx.sync();
  expect_same_bits(to_host(d_losses2), losses, "softmax_xent losses, repeated");
  expect_same_bits(to_host(d_lse2), lse, "softmax_xent lse, repeated");
  expect_same_bits(to_host(d_inplace), dlogits, "softmax_xent dlogits in place");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaSoftmaxXentTest,
                         ::testing::Values(XentShape{1, 1}, XentShape{1, 7}, XentShape{3, 33},
                                           XentShape{17, 1000}, XentShape{9, 32003},
                                           XentShape{128, 32000}));

// The device cannot throw: a target outside [−1, V) makes its row's loss and gradient NaN.
TEST(CudaSoftmaxXent, BadTargetGivesNan) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  const int64_t N = 3, V = 5;
  const std::vector<int32_t> targets = {2, 5, -2};
  const auto logits = normal(N * V, 54), dlosses = normal(N, 55);
  Context ctx;
  auto d_logits = to_device(logits), d_dlosses = to_device(dlosses);
  auto d_targets = to_device(targets);
  DeviceBuffer<float> d_losses(N), d_lse(N), d_dlogits(N * V);
  uploads_done();
  moetrain::cuda::softmax_xent_forward(d_losses.data(), d_lse.data(), d_logits.data(),
                                       d_targets.data(), N, V, ctx.stream());
  moetrain::cuda::softmax_xent_backward(d_dlogits.data(), d_dlosses.data(), d_logits.data(),
                                        d_lse.data(), d_targets.data(), N, V, ctx.stream());
  ctx.sync();
  const auto losses = to_host(d_losses), dlogits = to_host(d_dlogits);
  EXPECT_TRUE(std::isfinite(losses[0]));
  EXPECT_TRUE(std::isnan(losses[1]));
  EXPECT_TRUE(std::isnan(losses[2]));
  for (int64_t v = 0; v < V; ++v) {
    EXPECT_TRUE(std::isfinite(dlogits[v]));
    EXPECT_TRUE(std::isnan(dlogits[1 * V + v]));
    EXPECT_TRUE(std::isnan(dlogits[2 * V + v]));
  }
}

// ---------------------------------------------------------------------------------------------
// Zero sizes launch nothing (a zero grid is a launch error) and leave the outputs alone; the one
// exception is rmsnorm_backward's dweight, to which the CPU adds its (zero) sums even for N = 0.

TEST(CudaKernels, ZeroSizesLaunchNothing) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  Context ctx;
  const auto dweight0 = std::vector<float>{1.5f, -0.0f, 0.0f};
  auto d_dweight = to_device(dweight0);
  DeviceBuffer<float> d_one(8);
  uploads_done();
  const cudaStream_t s = ctx.stream();
  namespace cu = moetrain::cuda;
  cu::embedding_forward(nullptr, nullptr, d_one.data(), 0, 4, 2, s);
  cu::embedding_forward(nullptr, nullptr, d_one.data(), 3, 0, 2, s);
  cu::embedding_backward(d_one.data(), nullptr, nullptr, 0, 4, 2, s);
  cu::rmsnorm_forward(nullptr, nullptr, nullptr, d_one.data(), 0, 3, kNormEps, s);
  cu::rmsnorm_backward(nullptr, d_dweight.data(), nullptr, nullptr, d_one.data(), nullptr, 0, 3, s);
  cu::rope_forward(nullptr, nullptr, nullptr, 0, 2, 4, 10000.0f, s);
  cu::rope_backward(nullptr, nullptr, nullptr, 3, 0, 4, 10000.0f, s);
  cu::swiglu_forward(nullptr, nullptr, nullptr, 0, s);
  cu::swiglu_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, s);
  cu::add(nullptr, nullptr, nullptr, 0, s);
  cu::softmax_xent_forward(nullptr, nullptr, nullptr, nullptr, 0, 5, s);
  cu::softmax_xent_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 5, s);
  ctx.sync();
  // The CPU's dweight for N = 0: each element += 0.0f (−0 becomes +0).
  std::vector<float> dweight_cpu = dweight0;
  moetrain::rmsnorm_backward(nullptr, dweight_cpu.data(), nullptr, nullptr, nullptr, nullptr, 0, 3);
  expect_same_bits(to_host(d_dweight), dweight_cpu, "rmsnorm dweight for N = 0");
}

}  // namespace
