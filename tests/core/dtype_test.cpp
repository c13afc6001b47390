// fp16 (IEEE binary16) conversions against an independent double-precision reference: every
// bit pattern round-trips, ties go to even, subnormals underflow gradually, overflow gives Inf.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "support/expect_error.h"
#include "support/gradcheck.h"

using namespace moetrain;

namespace {

// The binary16 value nearest to f (ties to even), computed in double from the format's
// definition; ±Inf beyond the largest finite value's rounding boundary.
double fp16_reference(float f) {
  const double x = std::abs(static_cast<double>(f));
  double r;
  if (x >= 65520.0) {
    r = std::numeric_limits<double>::infinity();
  } else {
    const int e = x == 0.0 ? -14 : std::max(-14, static_cast<int>(std::floor(std::log2(x))));
    const double ulp = std::ldexp(1.0, e - 10);
    r = std::nearbyint(x / ulp) * ulp;  // default rounding mode: to nearest, ties to even
  }
  return std::signbit(f) ? -r : r;
}

}  // namespace

TEST(Fp16, EveryBitPatternRoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const fp16 h = fp16::from_bits(static_cast<uint16_t>(b));
    const float f = h.to_float();
    const bool nan = ((b >> 10) & 0x1f) == 0x1f && (b & 0x3ff) != 0;
    if (nan) {
      ASSERT_TRUE(std::isnan(f)) << b;
      // A NaN comes back a NaN with the quiet bit set and its payload kept.
      ASSERT_EQ(fp16(f).bits, b | 0x200u) << b;
    } else {
      ASSERT_EQ(fp16(f).bits, b) << "bits " << b << " value " << f;
    }
  }
}

TEST(Fp16, RoundsToNearestEvenLikeTheReference) {
  // Random magnitudes across the whole range (subnormal, normal, overflow), plus every float
  // halfway between two neighbouring binary16 values of a few binades.
  std::vector<float> values = moetrain::testing::random_vector(20000, 11);
  for (std::size_t i = 0; i < values.size(); ++i)
    values[i] = std::ldexp(values[i], static_cast<int>(i % 48) - 30);
  for (uint32_t b = 0; b < 0x7bff; b += 37) {
    const float lo = fp16::from_bits(static_cast<uint16_t>(b)).to_float();
    const float hi = fp16::from_bits(static_cast<uint16_t>(b + 1)).to_float();
    values.push_back(0.5f * (lo + hi));  // exact in f32: a tie
    values.push_back(std::nextafter(0.5f * (lo + hi), hi));
    values.push_back(-std::nextafter(0.5f * (lo + hi), lo));
  }
  for (float f : values) {
    const double want = fp16_reference(f);
    const float got = fp16(f).to_float();
    ASSERT_EQ(static_cast<double>(got), want) << "f = " << f;
    ASSERT_EQ(std::signbit(got), std::signbit(f)) << f;
  }
}

TEST(Fp16, SpecialValues) {
  EXPECT_EQ(fp16(1.0f).bits, 0x3c00);
  EXPECT_EQ(fp16(-2.0f).bits, 0xc000);
  EXPECT_EQ(fp16(0.0f).bits, 0x0000);
  EXPECT_EQ(fp16(-0.0f).bits, 0x8000);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: even is 1. 1 + 3·2^-11 rounds up to 1 + 2^-9.
  EXPECT_EQ(fp16(1.0f + 0x1p-11f).bits, 0x3c00);
  EXPECT_EQ(fp16(1.0f + 3 * 0x1p-11f).bits, 0x3c02);
  EXPECT_EQ(fp16(65504.0f).bits, 0x7bff);
  EXPECT_EQ(fp16(65519.0f).bits, 0x7bff);
  EXPECT_EQ(fp16(65520.0f).bits, 0x7c00);  // the tie next to an odd mantissa overflows
  EXPECT_EQ(fp16(-1e10f).bits, 0xfc00);
  EXPECT_EQ(fp16(std::numeric_limits<float>::infinity()).bits, 0x7c00);
  EXPECT_TRUE(std::isnan(fp16(std::numeric_limits<float>::quiet_NaN()).to_float()));
  // Subnormals: 2^-24 is the smallest; 2^-25 is a tie with 0 (even); 3·2^-25 ties to 2·2^-24.
  EXPECT_EQ(fp16(0x1p-24f).bits, 0x0001);
  EXPECT_EQ(fp16(0x1p-25f).bits, 0x0000);
  EXPECT_EQ(fp16(3 * 0x1p-25f).bits, 0x0002);
  EXPECT_EQ(fp16(0x1p-14f).bits, 0x0400);             // smallest normal
  EXPECT_EQ(fp16(0x1p-14f - 0x1p-26f).bits, 0x0400);  // rounds up out of the subnormals
  EXPECT_EQ(fp16::from_bits(0x03ff).to_float(), 1023 * 0x1p-24f);
}

TEST(Dtype, BulkConversionsMatchScalar) {
  std::vector<float> in =
      moetrain::testing::random_vector(70000, 3, 100.0f);  // over the parallel threshold
  std::vector<fp16> h(in.size());
  f32_to_fp16(h.data(), in.data(), in.size());
  std::vector<float> back(in.size());
  fp16_to_f32(back.data(), h.data(), in.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(h[i].bits, fp16(in[i]).bits);
    ASSERT_EQ(back[i], fp16(in[i]).to_float());
  }
  std::vector<uint16_t> raw(in.size());
  for (DType t : {DType::BF16, DType::F16}) {
    f32_to_dtype(t, raw.data(), in.data(), in.size());
    dtype_to_f32(t, back.data(), raw.data(), in.size());
    for (std::size_t i = 0; i < in.size(); ++i) ASSERT_EQ(back[i], round_to(t, in[i]));
  }
}

// The array rounding (AVX512_BF16's vcvtneps2bf16 where the CPU has it, core/bf16_round.h) gives
// bf16(float)'s bits for every upper half of a float's bits — every sign, exponent and leading
// mantissa, subnormals, infinities and NaNs — each with low halves below, at and above the tie
// (0x8000) and their neighbours, in an order that mixes subnormal lanes into normal vectors.
TEST(Bf16, ArrayRoundingMatchesTheScalarRuleBitForBit) {
  const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xc000, 0xffff};
  std::vector<float> in;
  for (uint32_t hi = 0; hi < 0x10000; ++hi)
    for (uint32_t lo : lows) in.push_back(std::bit_cast<float>(hi << 16 | lo));
  for (std::size_t i = in.size() - 1; i > 0; --i)  // a fixed shuffle
    std::swap(in[i], in[(i * 2654435761u) % (i + 1)]);
  std::vector<bf16> one(in.size()), bulk(in.size());
  round_to_bf16(one.data(), in.data(), static_cast<int64_t>(in.size()));
  f32_to_bf16(bulk.data(), in.data(), in.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    const uint16_t want = bf16(in[i]).bits;
    ASSERT_EQ(one[i].bits, want) << std::hex << std::bit_cast<uint32_t>(in[i]);
    ASSERT_EQ(bulk[i].bits, want) << std::hex << std::bit_cast<uint32_t>(in[i]);
  }
  // Lengths that are not a multiple of 16 end with the scalar rule.
  for (int64_t n : {1, 15, 17, 33}) {
    std::vector<bf16> part(static_cast<std::size_t>(n));
    round_to_bf16(part.data(), in.data() + 5, n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(part[i].bits, bf16(in[5 + i]).bits);
  }
}

TEST(Dtype, NamesParseAndBadNamesSayWhatIsAllowed) {
  EXPECT_EQ(parse_dtype("bf16", "train.precision"), DType::BF16);
  EXPECT_EQ(parse_dtype("fp16", "train.precision"), DType::F16);
  EXPECT_EQ(parse_dtype("f32", "train.precision"), DType::F32);
  EXPECT_EQ(dtype_name(DType::F16), "fp16");
  moetrain::testing::expect_error([] { parse_dtype("half", "train.precision"); },
                                  "train.precision = 'half': allowed are f32, bf16, fp16");
  moetrain::testing::expect_error(
      [] {
        parse_dtype("fp16", "dist.a2a_dtype", {DType::F32, DType::BF16});
      },
      "dist.a2a_dtype = 'fp16': allowed are f32, bf16");
}
