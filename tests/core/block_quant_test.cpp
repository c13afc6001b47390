// int8 block quantisation of the compressed gradient reduction: the round-trip error bound
// (|x − q·scale| ≤ scale / 2 with scale = max|x| / 127 per block of 256), the wire size, a NaN
// carried by its block's scale, and error feedback keeping the sum of what was sent within one
// residual of the true sum where plain rounding drifts; the AVX2 kernels equal the scalar ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/block_quant.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

float scale_of(const std::vector<uint8_t>& wire, int64_t block) {
  float s;
  std::memcpy(&s, wire.data() + block * 4, 4);
  return s;
}

}  // namespace

TEST(BlockQuant, RoundTripErrorIsAtMostHalfAScale) {
  for (int64_t n : {1, 255, 256, 257, 1000, 4096 + 17}) {
    std::vector<float> x = random_vector(n, 7 + static_cast<uint64_t>(n), 0.3f);
    for (int64_t i = 0; i < n; i += 300) x[i] *= 40.0f;  // blocks of very different ranges
    std::vector<uint8_t> wire(static_cast<std::size_t>(quant_wire_bytes(n)));
    ASSERT_EQ(quant_wire_bytes(n), n + 4 * ((n + 255) / 256));
    quantise_int8(wire.data(), x.data(), n);
    std::vector<float> y(static_cast<std::size_t>(n));
    dequantise_int8(y.data(), wire.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = i / kQuantBlock;
      float block_max = 0;
      for (int64_t j = b * kQuantBlock; j < std::min(n, (b + 1) * kQuantBlock); ++j)
        block_max = std::max(block_max, std::fabs(x[j]));
      const float scale = scale_of(wire, b);
      ASSERT_EQ(scale, block_max / 127.0f) << "n " << n << " block " << b;
      // Half a scale, plus the f32 rounding of x / scale and of q · scale.
      ASSERT_LE(std::fabs(x[i] - y[i]), scale * (0.5f + 1e-5f)) << "n " << n << " at " << i;
    }
  }
}

TEST(BlockQuant, ANonFiniteBlockDecodesToNaNAndCarriesNoResidual) {
  std::vector<float> x(600, 0.0f);
  x[300] = std::numeric_limits<float>::infinity();
  x[550] = 2.0f;
  std::vector<uint8_t> wire(static_cast<std::size_t>(quant_wire_bytes(600)));
  std::vector<float> residual(600, 0.25f), y(600);
  quantise_int8_feedback(wire.data(), x.data(), residual.data(), 600);
  dequantise_int8(y.data(), wire.data(), 600);
  // Block 0 sends its residual: 0.25 is the block's maximum, so it is 127 codes of 0.25 / 127.
  for (int i = 0; i < 256; ++i) EXPECT_NEAR(y[i], 0.25f, 1e-7f) << i;
  for (int i = 256; i < 512; ++i) {
    EXPECT_TRUE(std::isnan(y[i])) << i;
    EXPECT_EQ(residual[i], 0.0f) << "an overflow must not be carried into the next step";
  }
  EXPECT_NEAR(y[550], 2.25f, 1e-6f);  // block 2: the largest value is exact
}

TEST(BlockQuant, ErrorFeedbackKeepsTheSumOfWhatWasSentWithinOneResidual) {
  // Every block holds one large value and small ones below half a scale: plain rounding sends
  // the small ones as 0 every step, error feedback sends them as they accumulate.
  const int64_t n = 1024, steps = 300;
  std::vector<float> residual(n, 0.0f), sent_sum(n, 0.0f), plain_sum(n, 0.0f);
  std::vector<double> true_sum(n, 0.0);
  std::vector<uint8_t> wire(static_cast<std::size_t>(quant_wire_bytes(n)));
  std::vector<float> y(n);
  float max_scale = 0;
  for (int64_t t = 0; t < steps; ++t) {
    std::vector<float> g = random_vector(n, 100 + static_cast<uint64_t>(t), 0.001f);
    for (int64_t i = 0; i < n; i += kQuantBlock) g[i] = 1.0f;
    for (int64_t i = 0; i < n; ++i) true_sum[i] += g[i];
    quantise_int8_feedback(wire.data(), g.data(), residual.data(), n);
    dequantise_int8(y.data(), wire.data(), n);
    for (int64_t b = 0; b < quant_blocks(n); ++b) max_scale = std::max(max_scale, scale_of(wire, b));
    for (int64_t i = 0; i < n; ++i) sent_sum[i] += y[i];
    quantise_int8(wire.data(), g.data(), n);
    dequantise_int8(y.data(), wire.data(), n);
    for (int64_t i = 0; i < n; ++i) plain_sum[i] += y[i];
  }
  double fb_err = 0, plain_err = 0, res_max = 0;
  for (int64_t i = 0; i < n; ++i) {
    fb_err = std::max(fb_err, std::fabs(sent_sum[i] - true_sum[i]));
    plain_err = std::max(plain_err, std::fabs(plain_sum[i] - true_sum[i]));
    res_max = std::max(res_max, double(std::fabs(residual[i])));
  }
  // Σ sent = Σ true − residual (up to the f32 rounding of the running sums); the residual stays
  // within half a scale, whatever the number of steps.
  EXPECT_LE(res_max, 0.5 * max_scale * (1 + 1e-4));
  EXPECT_LE(fb_err, 0.5 * max_scale + 1e-3);
  EXPECT_GT(plain_err, 10 * fb_err) << "the test must tell feedback from plain rounding";
  std::printf("after %lld steps: |Σ sent − Σ true| ≤ %.5f with error feedback, %.5f without\n",
              static_cast<long long>(steps), fb_err, plain_err);
}

// The AVX2 kernels give the scalar kernels' bits: scales, codes and residuals, on blocks of every
// length up to one block, with values spanning many magnitudes, exact zeros, and a NaN or an Inf
// in the vector part or in the tail (a NaN scale either way).
TEST(BlockQuant, VectorPathEqualsScalar) {
  if (!quant_vector_path_available()) GTEST_SKIP() << "this CPU has no AVX2";
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t len = 1; len <= kQuantBlock; len += (len < 20 ? 1 : 13)) {
    std::vector<float> v(static_cast<std::size_t>(len));
    for (auto& x : v) x = nd(rng) * std::pow(10.0f, static_cast<float>(rng() % 9) - 4.0f);
    if (len > 3) v[2] = 0.0f, v[3] = -0.0f;
    const float s = quant_block_scale(v.data(), len, false);
    ASSERT_EQ(s, quant_block_scale(v.data(), len, true)) << len;
    for (float scale : {s, 0.0f, std::numeric_limits<float>::quiet_NaN()}) {
      std::vector<int8_t> q0(v.size()), q1(v.size());
      std::vector<float> r0(v.size()), r1(v.size());
      quant_block_codes(v.data(), len, scale, q0.data(), r0.data(), false);
      quant_block_codes(v.data(), len, scale, q1.data(), r1.data(), true);
      ASSERT_EQ(q0, q1) << len;
      ASSERT_EQ(0, std::memcmp(r0.data(), r1.data(), r0.size() * 4)) << len;
    }
    for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity()})
      for (int64_t at : {int64_t{0}, len - 1}) {
        std::vector<float> w = v;
        w[static_cast<std::size_t>(at)] = bad;
        EXPECT_TRUE(std::isnan(quant_block_scale(w.data(), len, false))) << len << " " << at;
        EXPECT_TRUE(std::isnan(quant_block_scale(w.data(), len, true))) << len << " " << at;
      }
  }
}
