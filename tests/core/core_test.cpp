#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "core/tensor.h"

using namespace moetrain;

namespace {
uint16_t bits_of(float f) {
  return bf16(f).bits;
}
float from_bits32(uint32_t u) {
  return std::bit_cast<float>(u);
}
}  // namespace

TEST(Check, CarriesFileLineAndValues) {
  try {
    int x = 3;
    MOETRAIN_CHECK(x == 4, "x is {}, expected 4", x);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "x is 3, expected 4");
    EXPECT_GT(e.line(), 0);
    EXPECT_NE(e.describe().find("core_test.cpp:"), std::string::npos) << e.describe();
  }
}

TEST(Bf16, ExactValuesRoundTrip) {
  for (float f : {0.0f, -0.0f, 1.0f, -2.0f, 0.5f, 65280.0f, 1.0f / 128}) {
    EXPECT_EQ(bf16(f).to_float(), f);
  }
  EXPECT_EQ(bits_of(1.0f), 0x3f80);
  EXPECT_EQ(bits_of(-0.0f), 0x8000);
}

TEST(Bf16, RoundsToNearestTiesToEven) {
  // 1 + 2^-8 is exactly halfway between bf16 1.0 (0x3f80) and 1+2^-7 (0x3f81): even is 0x3f80.
  EXPECT_EQ(bits_of(from_bits32(0x3f808000u)), 0x3f80);
  // 0x3f818000 is halfway between 0x3f81 and 0x3f82: even is 0x3f82.
  EXPECT_EQ(bits_of(from_bits32(0x3f818000u)), 0x3f82);
  // Just above / below halfway.
  EXPECT_EQ(bits_of(from_bits32(0x3f808001u)), 0x3f81);
  EXPECT_EQ(bits_of(from_bits32(0x3f807fffu)), 0x3f80);
  // Negative ties.
  EXPECT_EQ(bits_of(from_bits32(0xbf818000u)), 0xbf82);
}

TEST(Bf16, InfNanOverflow) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(bits_of(inf), 0x7f80);
  EXPECT_EQ(bits_of(-inf), 0xff80);
  EXPECT_TRUE(std::isnan(bf16(std::numeric_limits<float>::quiet_NaN()).to_float()));
  // A NaN whose payload sits only in the low 16 bits must stay NaN, not become Inf.
  float low_nan = from_bits32(0x7f800001u);
  ASSERT_TRUE(std::isnan(low_nan));
  EXPECT_TRUE(std::isnan(bf16(low_nan).to_float()));
  EXPECT_EQ(bits_of(from_bits32(0xff800001u)) & 0x8000, 0x8000);  // sign kept
  // The largest finite f32 rounds up to Inf; the largest bf16 stays finite.
  EXPECT_EQ(bits_of(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(bits_of(from_bits32(0x7f7f0000u)), 0x7f7f);
}

TEST(Bf16, Subnormals) {
  // Smallest bf16 subnormal: 2^-133 = bits 0x0001.
  float tiny = std::ldexp(1.0f, -133);
  EXPECT_EQ(bits_of(tiny), 0x0001);
  EXPECT_EQ(bf16::from_bits(0x0001).to_float(), tiny);
  // Half of it ties to even (zero); just above half rounds up.
  EXPECT_EQ(bits_of(std::ldexp(1.0f, -134)), 0x0000);
  EXPECT_EQ(bits_of(from_bits32(0x00008001u)), 0x0001);
  // Subnormal that rounds into the smallest normal.
  EXPECT_EQ(bits_of(from_bits32(0x007fffffu)), 0x0080);
}

TEST(Bf16, BulkMatchesScalar) {
  std::vector<float> in(100000);
  Rng rng(1, 2);
  rng_fill_normal(in.data(), in.size(), rng, 0, 100);
  std::vector<bf16> out(in.size());
  f32_to_bf16(out.data(), in.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(out[i].bits, bf16(in[i]).bits);
}

TEST(Rng, PhiloxKnownAnswer) {
  // Random123 known-answer test for Philox4x32-10, counter 0 and key 0.
  Rng rng(0, 0);
  auto b = rng.block(0);
  EXPECT_EQ(b[0], 0x6627e8d5u);
  EXPECT_EQ(b[1], 0xe169c58du);
  EXPECT_EQ(b[2], 0xbc57ac4cu);
  EXPECT_EQ(b[3], 0x9b00dbd8u);
  // Counter and key all ones.
  Rng ones(~0ull, ~0ull);
  auto c = ones.block(~0ull);
  EXPECT_EQ(c[0], 0x408f276du);
  EXPECT_EQ(c[1], 0x41c83b0eu);
  EXPECT_EQ(c[2], 0xa20bc7c6u);
  EXPECT_EQ(c[3], 0x6d5451fdu);
}

TEST(Rng, SameOutputWhateverTheThreadCount) {
  const int64_t n = 300001;
  std::vector<float> a(n), b(n);
  Rng rng(42, rng_stream(RngPurpose::Init, 0, 0));
  int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  rng_fill_normal(a.data(), n, rng, 0, 1);
  omp_set_num_threads(2);
  rng_fill_normal(b.data(), n, rng, 0, 1);
  omp_set_num_threads(saved);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(a[i]), std::bit_cast<uint32_t>(b[i]));
  // Moments of the normal draw.
  double mean = 0, var = 0;
  for (float v : a) mean += v;
  mean /= n;
  for (float v : a) var += (v - mean) * (v - mean);
  var /= n;
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(var, 1.0, 0.01);
}

TEST(Rng, StreamsDiffer) {
  EXPECT_NE(rng_stream(RngPurpose::Data, 1, 0), rng_stream(RngPurpose::Data, 0, 1));
  EXPECT_NE(rng_stream(RngPurpose::Data, 0, 0), rng_stream(RngPurpose::Init, 0, 0));
  Rng a(7, 1), b(7, 2);
  EXPECT_NE(a.u32(0), b.u32(0));
  // below() stays in range and covers it.
  std::vector<int> hist(7, 0);
  for (int i = 0; i < 7000; ++i) hist[a.below(i, 7)]++;
  for (int h : hist) EXPECT_GT(h, 800);
}

TEST(Tensor, AlignedViewsSlices) {
  Tensor t({4, 3});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
  EXPECT_EQ(t.numel(), 12);
  for (int i = 0; i < 12; ++i) t.f32()[i] = i;
  Tensor rows = t.slice(1, 3);
  EXPECT_EQ(rows.shape(), (Shape{2, 3}));
  EXPECT_EQ(rows.f32()[0], 3.0f);
  Tensor r2 = t[2];
  EXPECT_EQ(r2.shape(), (Shape{3}));
  EXPECT_EQ(r2.f32()[1], 7.0f);
  Tensor v = t.view({-1, 6});
  EXPECT_EQ(v.shape(), (Shape{2, 6}));
  v.f32()[0] = 100;  // shares storage
  EXPECT_EQ(t.f32()[0], 100.0f);
  EXPECT_THROW(t.view({5, 3}), Error);
  EXPECT_THROW(t.slice(2, 5), Error);
  EXPECT_THROW(t.bf(), Error);
  Tensor b = t.to(DType::BF16);
  EXPECT_EQ(b.dtype(), DType::BF16);
  EXPECT_EQ(b.bf()[5].to_float(), 5.0f);
  Tensor c = b.to(DType::F32);
  EXPECT_EQ(c.f32()[11], 11.0f);
  Tensor empty({0, 5});
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.slice(0, 0).numel(), 0);
}
