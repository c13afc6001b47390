// The bf16 attention core (kernels/attention.h, attention_forward_bf16 / attention_backward_bf16)
// against the f32 kernels (themselves checked against a double-precision reference in
// attention_test.cpp) on the same inputs rounded to bf16. Products of bf16 values are exact in
// f32, so what differs is the rounding of the probabilities and score gradients (2⁻⁹ of each,
// relative) and the order of f32 sums: the outputs and gradients agree to within 1% in relative
// norm, where a wrong index, scale or mask moves them by tens of percent.
#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/attention.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

struct Shape {
  int64_t B, T, NH, NKV, HS;
};

std::vector<float> rounded(std::vector<float> x) {
  for (float& v : x) v = static_cast<float>(bf16(v));
  return x;
}

double relative_norm(const std::vector<float>& got, const std::vector<float>& want) {
  double d = 0, w = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    d += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    w += double(want[i]) * want[i];
  }
  return std::sqrt(d / w);
}

struct Results {
  std::vector<float> out, lse, dq, dk, dv;
};

Results run(const Shape& s, bool bf, const std::vector<float>& q, const std::vector<float>& k,
            const std::vector<float>& v, const std::vector<float>& dout) {
  const auto [B, T, NH, NKV, HS] = s;
  Results r;
  r.out.assign(q.size(), 0), r.lse.assign(B * NH * T, 0);
  r.dq.assign(q.size(), 0), r.dk.assign(k.size(), 0), r.dv.assign(v.size(), 0);
  if (bf) {
    attention_forward_bf16(r.out.data(), r.lse.data(), q.data(), k.data(), v.data(), B, T, NH, NKV,
                           HS);
    attention_backward_bf16(r.dq.data(), r.dk.data(), r.dv.data(), dout.data(), q.data(), k.data(),
                            v.data(), r.out.data(), r.lse.data(), B, T, NH, NKV, HS);
  } else {
    attention_forward(r.out.data(), r.lse.data(), q.data(), k.data(), v.data(), B, T, NH, NKV, HS);
    attention_backward(r.dq.data(), r.dk.data(), r.dv.data(), dout.data(), q.data(), k.data(),
                       v.data(), r.out.data(), r.lse.data(), B, T, NH, NKV, HS);
  }
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return false;
  return true;
}

}  // namespace

TEST(AttentionBf16, MatchesTheF32KernelsOnRoundedInputs) {
  if (!attention_bf16_supported(64, 32)) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  // Partial blocks (T = 70, 34), padded head sizes (24, 40), grouped and plain heads.
  for (const Shape& s : {Shape{2, 64, 4, 2, 32}, Shape{3, 70, 4, 1, 24}, Shape{1, 34, 2, 2, 40},
                         Shape{2, 256, 4, 2, 64}, Shape{1, 2, 2, 1, 16}}) {
    const auto [B, T, NH, NKV, HS] = s;
    std::ostringstream where;
    where << "B" << B << " T" << T << " NH" << NH << " NKV" << NKV << " HS" << HS;
    const std::string at = where.str();
    const auto q = rounded(random_vector(B * T * NH * HS, 1, 1.5f));
    const auto k = rounded(random_vector(B * T * NKV * HS, 2, 1.5f));
    const auto v = rounded(random_vector(B * T * NKV * HS, 3));
    const auto dout = rounded(random_vector(B * T * NH * HS, 4));
    const Results want = run(s, false, q, k, v, dout), got = run(s, true, q, k, v, dout);
    std::cout << at << ": relative norms lse " << relative_norm(got.lse, want.lse) << ", out "
              << relative_norm(got.out, want.out) << ", dq " << relative_norm(got.dq, want.dq)
              << ", dk " << relative_norm(got.dk, want.dk) << ", dv "
              << relative_norm(got.dv, want.dv) << "\n";
    EXPECT_LT(relative_norm(got.lse, want.lse), 1e-5) << at;  // exact products, f32 sums
    EXPECT_LT(relative_norm(got.out, want.out), 1e-2) << at;
    EXPECT_LT(relative_norm(got.dq, want.dq), 1e-2) << at;
    EXPECT_LT(relative_norm(got.dk, want.dk), 1e-2) << at;
    EXPECT_LT(relative_norm(got.dv, want.dv), 1e-2) << at;
  }
}

// Every output is one task's, summed in a fixed order: the thread count changes no bit.
TEST(AttentionBf16, SameBitsAtAnyThreadCount) {
  if (!attention_bf16_supported(64, 32)) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  const Shape s{4, 96, 4, 2, 32};
  const auto [B, T, NH, NKV, HS] = s;
  const auto q = random_vector(B * T * NH * HS, 5), k = random_vector(B * T * NKV * HS, 6);
  const auto v = random_vector(B * T * NKV * HS, 7), dout = random_vector(B * T * NH * HS, 8);
  const int before = omp_get_max_threads();
  omp_set_num_threads(1);
  const Results one = run(s, true, q, k, v, dout);
  omp_set_num_threads(3);
  const Results three = run(s, true, q, k, v, dout);
  omp_set_num_threads(before);
  EXPECT_TRUE(same_bits(one.out, three.out));
  EXPECT_TRUE(same_bits(one.lse, three.lse));
  EXPECT_TRUE(same_bits(one.dq, three.dq));
  EXPECT_TRUE(same_bits(one.dk, three.dk));
  EXPECT_TRUE(same_bits(one.dv, three.dv));
}

TEST(AttentionBf16, NamesWhatItCannotRun) {
  EXPECT_FALSE(attention_bf16_supported(63, 32));    // odd T
  EXPECT_FALSE(attention_bf16_supported(64, 33));    // odd HS
  EXPECT_FALSE(attention_bf16_supported(1024, 32));  // past one pass's buffers
  std::vector<float> buf(1 << 16);
  float* f = buf.data();
  try {
    attention_forward_bf16(f, f, f, f, f, 1, 63, 2, 1, 32);
    FAIL() << "odd T ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("T=63"), std::string::npos) << e.what();
  }
}
