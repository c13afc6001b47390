#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <limits>
#include <cstring>
#include <sstream>
#include <vector>

#include "core/check.h"
#include "kernels/attention.h"
#include "kernels/attention_rows.h"
#include "kernels/tile_gemm.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

struct Shape {
  int64_t B, T, NH, NKV, HS;
};

std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << "B" << s.B << "_T" << s.T << "_NH" << s.NH << "_NKV" << s.NKV << "_HS" << s.HS;
}

// Inputs and the double-precision reference results for one shape.
struct Problem {
  Shape s;
  std::vector<float> q, k, v, dout;
  int64_t nq() const { return s.B * s.T * s.NH * s.HS; }
  int64_t nkv() const { return s.B * s.T * s.NKV * s.HS; }
  int64_t nlse() const { return s.B * s.NH * s.T; }

  explicit Problem(Shape shape, uint64_t seed = 1, float qk_std = 1.0f) : s(shape) {
    q = random_vector(nq(), seed, qk_std);
    k = random_vector(nkv(), seed + 1, qk_std);
    v = random_vector(nkv(), seed + 2);
    dout = random_vector(nq(), seed + 3);
  }
  int64_t qi(int64_t b, int64_t t, int64_t h) const { return ((b * s.T + t) * s.NH + h) * s.HS; }
  int64_t ki(int64_t b, int64_t t, int64_t g) const { return ((b * s.T + t) * s.NKV + g) * s.HS; }
};

struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

// Naive attention in double: the full (T, T) score matrix per (b, h), masked, softmaxed, applied,
// then the textbook softmax backward.
Reference reference(const Problem& p) {
  const auto [B, T, NH, NKV, HS] = p.s;
  const int64_t G = NH / NKV;
  const double scale = 1.0 / std::sqrt(double(HS));
  Reference r;
  r.out.assign(p.nq(), 0);
  r.lse.assign(p.nlse(), 0);
  r.dq.assign(p.nq(), 0);
  r.dk.assign(p.nkv(), 0);
  r.dv.assign(p.nkv(), 0);
  std::vector<double> P(T * T), dP(T * T);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t g = h / G;
      for (int64_t i = 0; i < T; ++i) {
        double m = -INFINITY;
        for (int64_t j = 0; j < T; ++j) {
          double sc = -INFINITY;
          if (j <= i) {
            sc = 0;
            for (int64_t x = 0; x < HS; ++x)
              sc += double(p.q[p.qi(b, i, h) + x]) * p.k[p.ki(b, j, g) + x];
            sc *= scale;
          }
          P[i * T + j] = sc;
          m = std::max(m, sc);
        }
        double l = 0;
        for (int64_t j = 0; j < T; ++j) l += (P[i * T + j] = std::exp(P[i * T + j] - m));
        for (int64_t j = 0; j < T; ++j) P[i * T + j] /= l;
        r.lse[(b * NH + h) * T + i] = m + std::log(l);
        for (int64_t j = 0; j < T; ++j) {
          for (int64_t x = 0; x < HS; ++x)
            r.out[p.qi(b, i, h) + x] += P[i * T + j] * p.v[p.ki(b, j, g) + x];
        }
      }
      for (int64_t i = 0; i < T; ++i) {
        double rowdot = 0;
        for (int64_t j = 0; j < T; ++j) {
          double d = 0;
          for (int64_t x = 0; x < HS; ++x)
            d += double(p.dout[p.qi(b, i, h) + x]) * p.v[p.ki(b, j, g) + x];
          dP[i * T + j] = d;
          rowdot += P[i * T + j] * d;
        }
        for (int64_t j = 0; j < T; ++j) {
          const double ds = P[i * T + j] * (dP[i * T + j] - rowdot) * scale;
          for (int64_t x = 0; x < HS; ++x) {
            r.dq[p.qi(b, i, h) + x] += ds * p.k[p.ki(b, j, g) + x];
            r.dk[p.ki(b, j, g) + x] += ds * p.q[p.qi(b, i, h) + x];
            r.dv[p.ki(b, j, g) + x] += P[i * T + j] * p.dout[p.qi(b, i, h) + x];
          }
        }
      }
    }
  }
  return r;
}

struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

Result run(const Problem& p) {
  const auto [B, T, NH, NKV, HS] = p.s;
  Result r{std::vector<float>(p.nq()), std::vector<float>(p.nlse()), std::vector<float>(p.nq()),
           std::vector<float>(p.nkv()), std::vector<float>(p.nkv())};
  attention_forward(r.out.data(), r.lse.data(), p.q.data(), p.k.data(), p.v.data(), B, T, NH, NKV,
                    HS);
  attention_backward(r.dq.data(), r.dk.data(), r.dv.data(), p.dout.data(), p.q.data(), p.k.data(),
                     p.v.data(), r.out.data(), r.lse.data(), B, T, NH, NKV, HS);
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// run(p) with `threads` OpenMP threads.
Result run_with_threads(const Problem& p, int threads) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  Result r = run(p);
  omp_set_num_threads(saved);
  return r;
}

void expect_same_bits(const Result& a, const Result& b) {
  EXPECT_TRUE(same_bits(a.out, b.out));
  EXPECT_TRUE(same_bits(a.lse, b.lse));
  EXPECT_TRUE(same_bits(a.dq, b.dq));
  EXPECT_TRUE(same_bits(a.dk, b.dk));
  EXPECT_TRUE(same_bits(a.dv, b.dv));
}

}  // namespace

class AttentionTest : public ::testing::TestWithParam<Shape> {};

TEST_P(AttentionTest, ForwardBackwardMatchReference) {
  Problem p(GetParam());
  const Result got = run(p);
  const Reference want = reference(p);
  expect_close(got.out.data(), want.out.data(), p.nq(), 1e-5, 1e-4, "out");
  expect_close(got.lse.data(), want.lse.data(), p.nlse(), 1e-5, 1e-5, "lse");
  expect_close(got.dq.data(), want.dq.data(), p.nq(), 1e-4, 1e-3, "dq");
  expect_close(got.dk.data(), want.dk.data(), p.nkv(), 1e-4, 1e-3, "dk");
  expect_close(got.dv.data(), want.dv.data(), p.nkv(), 1e-4, 1e-3, "dv");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionTest,
    ::testing::Values(Shape{0, 4, 2, 1, 8}, Shape{2, 0, 2, 1, 8}, Shape{1, 1, 1, 1, 1},
                      Shape{1, 1, 4, 2, 8}, Shape{2, 5, 4, 2, 8},  // GQA
                      Shape{1, 37, 3, 3, 16},                      // MHA, odd T
                      Shape{2, 37, 4, 1, 12},                      // multi-query
                      Shape{1, 70, 4, 2, 64},                      // several blocks
                      Shape{1, 65, 6, 2, 33},
                      Shape{1, 300, 2, 1, 16}),  // reductions longer than one chunk
    [](const auto& info) {
      std::ostringstream os;
      os << info.param;
      return os.str();
    });

TEST(Attention, LargeScoresStayFinite) {
  // Scores in the hundreds overflow exp without the max subtraction.
  Problem p({2, 19, 4, 2, 16}, 7, 12.0f);
  const Result got = run(p);
  const Reference want = reference(p);
  expect_close(got.out.data(), want.out.data(), p.nq(), 1e-4, 1e-4, "out");
  expect_close(got.lse.data(), want.lse.data(), p.nlse(), 1e-3, 1e-5, "lse");
  for (float x : got.dq) ASSERT_TRUE(std::isfinite(x));
  for (float x : got.dk) ASSERT_TRUE(std::isfinite(x));
}

TEST(Attention, GradientsMatchFiniteDifferences) {
  for (Shape s : {Shape{1, 6, 4, 2, 8}, Shape{2, 9, 2, 1, 5}, Shape{1, 40, 2, 2, 4}}) {
    SCOPED_TRACE(::testing::PrintToString(s));
    Problem p(s, 11);
    const Result got = run(p);  // dout plays R in the loss sum(out ⊙ R)
    auto loss = [&] {
      std::vector<float> out(p.nq()), lse(p.nlse());
      attention_forward(out.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s.B, s.T, s.NH,
                        s.NKV, s.HS);
      double sum = 0;
      for (int64_t i = 0; i < p.nq(); ++i) sum += double(out[i]) * p.dout[i];
      return sum;
    };
    check_gradient(p.q.data(), got.dq.data(), p.nq(), loss, "dq");
    check_gradient(p.k.data(), got.dk.data(), p.nkv(), loss, "dk");
    check_gradient(p.v.data(), got.dv.data(), p.nkv(), loss, "dv");
  }
}

// The backward runs in one pass where its (batch, kv head) tasks keep every thread busy
// (B·NKV >= 2 threads) and T fits, else in two (a dq pass and a dk/dv pass); both form the same
// values with the same sums, so they must agree bit for bit. With B·NKV = 4: 1 thread takes one
// pass, 3 threads two.
TEST(Attention, OnePassAndTwoPassBackwardGiveTheSameBits) {
  for (Shape s : {Shape{2, 100, 4, 2, 24}, Shape{4, 300, 2, 1, 16}, Shape{1, 70, 8, 4, 64}}) {
    SCOPED_TRACE(::testing::PrintToString(s));
    Problem p(s, 31);
    expect_same_bits(run_with_threads(p, 1), run_with_threads(p, 3));
  }
}

TEST(Attention, BitwiseIdenticalAcrossThreadCounts) {
  Problem p({3, 160, 4, 2, 24}, 21);
  expect_same_bits(run_with_threads(p, 1), run_with_threads(p, 2));
}

TEST(Attention, CausalMaskHidesLaterPositions) {
  const Shape s{2, 45, 4, 2, 16};
  Problem p(s, 31);
  const Result base = run(p);
  for (int64_t t : {1, 17, 33, 44}) {
    Problem changed = p;
    for (int64_t b = 0; b < s.B; ++b) {
      for (int64_t g = 0; g < s.NKV; ++g) {
        for (int64_t x = 0; x < s.HS; ++x) {
          changed.k[p.ki(b, t, g) + x] += 5.0f;
          changed.v[p.ki(b, t, g) + x] -= 3.0f;
        }
      }
    }
    const Result got = run(changed);
    for (int64_t b = 0; b < s.B; ++b) {
      for (int64_t h = 0; h < s.NH; ++h) {
        for (int64_t i = 0; i < s.T; ++i) {
          const int64_t at = p.qi(b, i, h), li = (b * s.NH + h) * s.T + i;
          const bool same = std::memcmp(&got.out[at], &base.out[at], s.HS * sizeof(float)) == 0 &&
                            got.lse[li] == base.lse[li] &&
                            std::memcmp(&got.dq[at], &base.dq[at], s.HS * sizeof(float)) == 0;
          // Earlier positions must not move at all; position t itself must.
          if (i < t) {
            EXPECT_TRUE(same) << "t=" << t << " changed b=" << b << " h=" << h << " i=" << i;
          } else if (i == t) {
            EXPECT_FALSE(same) << "t=" << t << " had no effect on itself";
          }
        }
      }
    }
  }
}

// The AVX-512 tile path gives the 8-float path's bits (every C element the same sequential sum),
// over shapes with partial row tiles, tiles of one and two column blocks (N = 16, 32, 48, 64, 80),
// several reduction chunks, padded leading dimensions, A plain and transposed, with and without
// accumulation.
TEST(Attention, TileGemmSameBitsOnEveryPath) {
  if (!__builtin_cpu_supports("avx512f")) GTEST_SKIP() << "this CPU has no AVX-512";
  uint64_t seed = 100;
  for (int64_t M : {1, 3, 4, 5, 9, 32})
    for (int64_t N : {16, 32, 48, 64, 80})
      for (int64_t K : {1, 31, 129, 300})
        for (bool acc : {false, true})
          for (bool ta : {false, true}) {
            const int64_t rows = (M + 3) / 4 * 4, lda = ta ? M + 5 : K + 3, ldb = N + 16,
                          ldc = N + 16;
            const auto A = random_vector((ta ? K : rows) * lda, ++seed);
            const auto B = random_vector(K * ldb, ++seed), C0 = random_vector(rows * ldc, ++seed);
            std::vector<float> narrow = C0, wide = C0;
            attention_tile_gemm(false, narrow.data(), ldc, A.data(), lda, B.data(), ldb, M, N, K,
                                acc, ta);
            attention_tile_gemm(true, wide.data(), ldc, A.data(), lda, B.data(), ldb, M, N, K, acc,
                                ta);
            ASSERT_TRUE(same_bits(narrow, wide)) << "M=" << M << " N=" << N << " K=" << K
                                                 << " accumulate=" << acc << " trans_a=" << ta;
          }
}

// A causal product gives the full product's bits where its rows read them, on both paths: the
// columns up to each row's limit (Columns; those past a tile's last row's limit stay unwritten),
// and the whole row where the terms past each row's limit (TermsTo) or before its start
// (TermsFrom, accumulating, A transposed) are zeros.
TEST(Attention, TileGemmCausalGivesTheFullProductsBits) {
  uint64_t seed = 200;
  for (int64_t M : {1, 5, 12, 32})
    for (int64_t offset : {0, 1, 3, 9, 32})
      for (bool wide : {false, true}) {
        const int64_t rows = (M + 3) / 4 * 4, N = (M + offset + 15) / 16 * 16, K = 40, ld = N + 16;
        const auto A = random_vector(rows * K, ++seed), B = random_vector(K * ld, ++seed);
        const float poison = std::numeric_limits<float>::quiet_NaN();
        std::vector<float> full(rows * ld, poison), causal(rows * ld, poison);
        attention_tile_gemm(wide, full.data(), ld, A.data(), K, B.data(), ld, M, N, K, false);
        attention_tile_gemm(wide, causal.data(), ld, A.data(), K, B.data(), ld, M, N, K, false,
                            false, {TileCausal::Columns, offset});
        for (int64_t i = 0; i < M; ++i)
          for (int64_t c = 0; c <= std::min(N - 1, i + offset); ++c)
            ASSERT_EQ(std::bit_cast<uint32_t>(full[i * ld + c]),
                      std::bit_cast<uint32_t>(causal[i * ld + c]))
                << "Columns M=" << M << " offset=" << offset << " wide=" << wide << " (" << i
                << ", " << c << ")";

        // TermsTo: row i of A (M, Kt) is zero past index i + offset.
        const int64_t Kt = M + offset;
        auto P = random_vector(rows * Kt, ++seed);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t k = std::min(i, M - 1) + offset + 1; k < Kt; ++k) P[i * Kt + k] = 0.0f;
        const auto V = random_vector(Kt * 32, ++seed);
        std::vector<float> whole(rows * 32), cut(rows * 32, poison);
        attention_tile_gemm(wide, whole.data(), 32, P.data(), Kt, V.data(), 32, M, 32, Kt, false);
        attention_tile_gemm(wide, cut.data(), 32, P.data(), Kt, V.data(), 32, M, 32, Kt, false,
                            false, {TileCausal::TermsTo, offset});
        for (int64_t i = 0; i < M; ++i)
          for (int64_t c = 0; c < 32; ++c)
            ASSERT_EQ(std::bit_cast<uint32_t>(whole[i * 32 + c]),
                      std::bit_cast<uint32_t>(cut[i * 32 + c]))
                << "TermsTo M=" << M << " offset=" << offset << " wide=" << wide << " (" << i << ", "
                << c << ")";

        // TermsFrom, accumulating into C, A stored transposed (Kt, M): row i's terms before index
        // i + offset are zeros.
        auto Pt = random_vector(Kt * rows, ++seed);
        for (int64_t k = 0; k < Kt; ++k)
          for (int64_t i = 0; i < rows; ++i)
            if (k < i + offset) Pt[k * rows + i] = 0.0f;
        const auto C0 = random_vector(rows * 32, ++seed);
        std::vector<float> all = C0, from = C0;
        attention_tile_gemm(wide, all.data(), 32, Pt.data(), rows, V.data(), 32, M, 32, Kt, true,
                            true);
        attention_tile_gemm(wide, from.data(), 32, Pt.data(), rows, V.data(), 32, M, 32, Kt, true,
                            true, {TileCausal::TermsFrom, offset});
        for (int64_t i = 0; i < M; ++i)
          for (int64_t c = 0; c < 32; ++c)
            ASSERT_EQ(std::bit_cast<uint32_t>(all[i * 32 + c]),
                      std::bit_cast<uint32_t>(from[i * 32 + c]))
                << "TermsFrom M=" << M << " offset=" << offset << " wide=" << wide << " (" << i
                << ", " << c << ")";
      }
}

// The 16-lane AVX-512 rows give the 8-lane rows' bits: the softmax (its probabilities, maximum
// and sum) and the backward's probabilities and score gradients, over row lengths with and
// without a partial vector of either width, scores that underflow, and a row of equal scores. A
// block's softmax, its rows four at a time, gives each row the bits of that row taken alone.
TEST(Attention, RowsSameBitsOnEveryPath) {
  const bool avx512 = __builtin_cpu_supports("avx512f");
  uint64_t seed = 300;
  for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 24, 31, 33, 64, 100, 129, 512}) {
    for (float spread : {1.0f, 40.0f, 0.0f}) {
      // A block of M rows, row r seeing n + r columns, the keys nk past the last row's.
      for (int64_t M : {1, 3, 4, 7, 32}) {
        const int64_t nk = n + M - 1 + 5, ld = (nk + 15) / 16 * 16 + 16;
        auto block = random_vector(M * ld, ++seed);
        for (float& x : block) x *= spread;
        std::vector<RowSoftmax> sm_block(M), sm_row(M), sm_narrow(M);
        std::vector<float> whole = block, alone = block, narrow = block;
        attention_softmax_rows(true, sm_block.data(), whole.data(), ld, M, n, nk, 0.17f);
        attention_softmax_rows(false, sm_narrow.data(), narrow.data(), ld, M, n, nk, 0.17f);
        for (int64_t r = 0; r < M; ++r)
          attention_softmax_rows(true, &sm_row[r], alone.data() + r * ld, ld, 1, n + r, nk, 0.17f);
        for (int64_t r = 0; r < M; ++r) {
          for (int64_t c = 0; c < nk; ++c) {
            const float x = whole[r * ld + c];
            ASSERT_EQ(std::bit_cast<uint32_t>(x), std::bit_cast<uint32_t>(alone[r * ld + c]))
                << "block against row alone: n=" << n << " M=" << M << " (" << r << ", " << c
                << ")";
            ASSERT_EQ(std::bit_cast<uint32_t>(x), std::bit_cast<uint32_t>(narrow[r * ld + c]))
                << "wide against narrow: n=" << n << " M=" << M << " (" << r << ", " << c << ")";
            if (c >= n + r) {
              ASSERT_EQ(std::bit_cast<uint32_t>(x), 0u) << "past the row's end";
            }
          }
          for (const RowSoftmax* other : {&sm_row[r], &sm_narrow[r]}) {
            ASSERT_EQ(std::bit_cast<uint32_t>(sm_block[r].m), std::bit_cast<uint32_t>(other->m))
                << "n=" << n << " M=" << M << " r=" << r;
            ASSERT_EQ(std::bit_cast<uint64_t>(sm_block[r].l), std::bit_cast<uint64_t>(other->l))
                << "n=" << n << " M=" << M << " r=" << r;
          }
        }
      }
      if (!avx512) continue;
      const int64_t cols = (n + 15) / 16 * 16;
      auto row = random_vector(cols, ++seed);
      for (float& x : row) x *= spread;
      const auto dp = random_vector(cols, ++seed);
      std::vector<float> s_narrow = row, s_wide = row, dp_narrow = dp, dp_wide = dp;
      attention_p_ds_row(false, s_narrow.data(), dp_narrow.data(), n, 0.17f, 0.3f, -0.2f);
      attention_p_ds_row(true, s_wide.data(), dp_wide.data(), n, 0.17f, 0.3f, -0.2f);
      ASSERT_TRUE(same_bits(s_narrow, s_wide)) << "p n=" << n << " spread=" << spread;
      ASSERT_TRUE(same_bits(dp_narrow, dp_wide)) << "ds n=" << n << " spread=" << spread;
    }
  }
}

TEST(Attention, RejectsBadArguments) {
  std::vector<float> buf(4096);
  float* f = buf.data();
  EXPECT_THROW(attention_forward(f, f, f, f, f, 1, 4, 6, 4, 8), Error);  // NH % NKV != 0
  EXPECT_THROW(attention_forward(f, f, f, f, f, 1, 4, 4, 0, 8), Error);
  EXPECT_THROW(attention_forward(f, f, f, f, f, 1, 4, 4, 2, 0), Error);
  EXPECT_THROW(attention_forward(f, f, f, f, f, 1, -1, 4, 2, 8), Error);
  EXPECT_THROW(attention_forward(nullptr, f, f, f, f, 1, 4, 4, 2, 8), Error);
  EXPECT_THROW(attention_backward(f, f, f, f, f, f, f, f, f, 1, 4, 6, 4, 8), Error);
  EXPECT_THROW(attention_backward(f, f, f, f, f, f, f, f, f, -2, 4, 4, 2, 8), Error);
  try {
    attention_forward(f, f, f, f, f, 1, 4, 6, 4, 8);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NH=6"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("NKV=4"), std::string::npos) << e.what();
  }
}
