#include <gtest/gtest.h>
#include <omp.h>

#include <cstring>
#include <utility>
#include <vector>

#include "kernels/det_gemm.h"
#include "support/error_bound.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

int64_t sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

// Runs f with 1 and then 2 threads and expects the same bits.
void expect_thread_invariant(const std::function<std::vector<float>()>& f) {
  int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  auto a = f();
  omp_set_num_threads(2);
  auto b = f();
  omp_set_num_threads(saved);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "1 vs 2 threads";
}

}  // namespace

struct GemmShape {
  std::vector<int64_t> rows;
  int64_t N, K;
};

class DetGemmTest : public ::testing::TestWithParam<GemmShape> {};

TEST_P(DetGemmTest, GroupedGemmMatchesReference) {
  const GemmShape sh = GetParam();
  const int64_t G = sh.rows.size(), R = sum(sh.rows), N = sh.N, K = sh.K;
  auto A = random_vector(R * K, 1), B = random_vector(G * N * K, 2);
  for (Trans tb : {Trans::N, Trans::T}) {
    for (bool acc : {false, true}) {
      std::vector<float> C = random_vector(R * N, 3);
      std::vector<Bounded> ref(R * N);
      int64_t row = 0;
      for (int64_t g = 0; g < G; ++g) {
        const float* Bg = B.data() + g * N * K;
        for (int64_t m = row; m < row + sh.rows[g]; ++m) {
          for (int64_t n = 0; n < N; ++n) {
            BoundedSum s;
            if (acc) s.add(Bounded{C[m * N + n]});
            for (int64_t k = 0; k < K; ++k)
              s.add(A[m * K + k], tb == Trans::T ? Bg[n * K + k] : Bg[k * N + n]);
            ref[m * N + n] = s.result();
          }
        }
        row += sh.rows[g];
      }
      grouped_gemm_det(tb, G, sh.rows.data(), N, K, A.data(), B.data(), N * K, C.data(), acc);
      expect_within(C, ref, "grouped_gemm_det");
    }
  }
  expect_thread_invariant([&] {
    std::vector<float> C(R * N);
    grouped_gemm_det(Trans::T, G, sh.rows.data(), N, K, A.data(), B.data(), N * K, C.data(), false);
    return C;
  });
}

// Two problems at once: C1_g (P, Q) [+]= A_gᵀ B_g and C2_g (Q, P) [+]= B_gᵀ A_g.
TEST_P(DetGemmTest, ReduceMatchesReference) {
  const GemmShape sh = GetParam();
  const int64_t G = sh.rows.size(), R = sum(sh.rows), P = sh.N, Q = sh.K;
  auto A = random_vector(R * P, 4), B = random_vector(R * Q, 5);
  for (bool acc : {false, true}) {
    std::vector<float> C1 = random_vector(G * P * Q, 6), C2 = random_vector(G * P * Q, 7);
    // A reduction split into chunks is still one sum of the same terms in some order.
    std::vector<Bounded> r1(G * P * Q), r2(G * P * Q);
    int64_t row = 0;
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t p = 0; p < P; ++p) {
        for (int64_t q = 0; q < Q; ++q) {
          BoundedSum s1, s2;
          if (acc) {
            s1.add(Bounded{C1[g * P * Q + p * Q + q]});
            s2.add(Bounded{C2[g * P * Q + q * P + p]});
          }
          for (int64_t m = row; m < row + sh.rows[g]; ++m) {
            s1.add(A[m * P + p], B[m * Q + q]);
            s2.add(A[m * P + p], B[m * Q + q]);
          }
          r1[g * P * Q + p * Q + q] = s1.result();
          r2[g * P * Q + q * P + p] = s2.result();
        }
      }
      row += sh.rows[g];
    }
    const ReduceProblem problems[2] = {{P, Q, A.data(), B.data(), C1.data(), P * Q},
                                       {Q, P, B.data(), A.data(), C2.data(), P * Q}};
    grouped_gemm_reduce_det(G, sh.rows.data(), problems, 2, acc);
    expect_within(C1, r1, "reduce C1");
    expect_within(C2, r2, "reduce C2");
  }
  // An empty group is left untouched when accumulating.
  std::vector<float> C(G * P * Q, 5.0f);
  grouped_gemm_reduce_det(G, sh.rows.data(), P, Q, A.data(), B.data(), C.data(), P * Q, true);
  for (int64_t g = 0; g < G; ++g) {
    if (sh.rows[g] > 0) continue;
    for (int64_t i = 0; i < P * Q; ++i) ASSERT_EQ(C[g * P * Q + i], 5.0f);
  }
  expect_thread_invariant([&] {
    std::vector<float> C(G * P * Q, 1.0f);
    grouped_gemm_reduce_det(G, sh.rows.data(), P, Q, A.data(), B.data(), C.data(), P * Q, true);
    return C;
  });
}

// A narrow product's rows (kernels/tile_gemm) come out the same bits whatever block of rows
// they are computed in: a router's logits do not depend on how its tokens are cut into tasks.
TEST(DetGemm, NarrowRowsSameBitsInAnyBlock) {
  for (auto [N, K] : {std::pair<int64_t, int64_t>{8, 128}, {128, 8}, {5, 64}}) {
    for (Trans tb : {Trans::N, Trans::T}) {
      const int64_t M = 301, cut = 150;
      auto A = random_vector(M * K, 8), B = random_vector(N * K, 9);
      std::vector<float> whole = random_vector(M * N, 10), parts = whole;
      task_gemm(tb, M, N, K, A.data(), B.data(), whole.data(), true);
      task_gemm(tb, cut, N, K, A.data(), B.data(), parts.data(), true);
      task_gemm(tb, M - cut, N, K, A.data() + cut * K, B.data(), parts.data() + cut * N, true);
      EXPECT_EQ(0, std::memcmp(whole.data(), parts.data(), whole.size() * sizeof(float)))
          << "N=" << N << " K=" << K << " tb=" << (tb == Trans::T ? "T" : "N");
    }
  }
}

// Small shapes run as plain loops; larger ones through oneDNN in row blocks, and a group of
// more than 2048 rows splits its reduction into summed chunks. Products with a side under 16
// (a router's: N or K of 8, a reduction's P of 8 with Q a multiple of 16) take the tile kernel,
// rows past the last whole tile of 4 through a scratch tile.
INSTANTIATE_TEST_SUITE_P(Shapes, DetGemmTest,
                         ::testing::Values(GemmShape{{}, 4, 3}, GemmShape{{0}, 4, 3},
                                           GemmShape{{1}, 1, 1}, GemmShape{{3, 0, 5}, 6, 7},
                                           GemmShape{{0, 300, 1, 0, 557}, 33, 20},
                                           GemmShape{{4500, 7}, 9, 12},
                                           GemmShape{{1027, 0, 513}, 8, 128},
                                           GemmShape{{2049, 66}, 8, 32},
                                           GemmShape{{515, 301}, 128, 8}));
