#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>

#include "core/check.h"
#include "kernels/norm.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {
// Bitwise equality (memcmp would be handed null pointers for empty buffers).
bool same_bits(const float* a, const float* b, int64_t n) {
  return n == 0 || std::memcmp(a, b, sizeof(float) * n) == 0;
}
constexpr float kEps = 1e-5f;

struct NormRef {
  std::vector<double> out, rstd, dinp, dweight;
};

NormRef rmsnorm_ref(const std::vector<float>& x, const std::vector<float>& w,
                    const std::vector<float>& dy, int64_t N, int64_t C, double eps) {
  NormRef r{std::vector<double>(N * C), std::vector<double>(N), std::vector<double>(N * C),
            std::vector<double>(C, 0.0)};
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += double(x[n * C + c]) * x[n * C + c];
    const double rs = 1.0 / std::sqrt(ss / C + eps);
    r.rstd[n] = rs;
    double dot = 0;
    for (int64_t c = 0; c < C; ++c) {
      r.out[n * C + c] = w[c] * x[n * C + c] * rs;
      dot += double(dy[n * C + c]) * w[c] * x[n * C + c];
      r.dweight[c] += double(dy[n * C + c]) * x[n * C + c] * rs;
    }
    for (int64_t c = 0; c < C; ++c) {
      r.dinp[n * C + c] = rs * w[c] * dy[n * C + c] - rs * rs * rs * x[n * C + c] * dot / C;
    }
  }
  return r;
}

// Runs forward + backward with a given OpenMP thread count; dweight starts from `dweight0`.
void run_norm(int threads, std::vector<float>& out, std::vector<float>& dinp,
              std::vector<float>& dweight, const std::vector<float>& x, const std::vector<float>& w,
              const std::vector<float>& dy, int64_t N, int64_t C) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  std::vector<float> rstd(N);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
  rmsnorm_backward(dinp.data(), dweight.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
  omp_set_num_threads(saved);
}
}  // namespace

class RmsNormTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(RmsNormTest, ForwardMatchesReference) {
  const auto [N, C] = GetParam();
  auto x = random_vector(N * C, 1, 2.0f), w = random_vector(C, 2), dy = random_vector(N * C, 3);
  std::vector<float> out(N * C), rstd(N);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
  auto ref = rmsnorm_ref(x, w, dy, N, C, kEps);
  expect_close(out.data(), ref.out.data(), N * C, 1e-6, 1e-5, "rmsnorm out");
  expect_close(rstd.data(), ref.rstd.data(), N, 1e-6, 1e-6, "rmsnorm rstd");
  // In place gives the same bits.
  std::vector<float> inplace = x, rstd2(N);
  rmsnorm_forward(inplace.data(), rstd2.data(), inplace.data(), w.data(), N, C, kEps);
  EXPECT_TRUE(same_bits(inplace.data(), out.data(), N * C));
}

TEST_P(RmsNormTest, BackwardMatchesReferenceAndFiniteDifferences) {
  const auto [N, C] = GetParam();
  auto x = random_vector(N * C, 4, 1.5f), w = random_vector(C, 5), dy = random_vector(N * C, 6);
  std::vector<float> out(N * C), rstd(N), dinp(N * C, 7.0f), dweight(C, 0.5f);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
  rmsnorm_backward(dinp.data(), dweight.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
  auto ref = rmsnorm_ref(x, w, dy, N, C, kEps);
  expect_close(dinp.data(), ref.dinp.data(), N * C, 1e-5, 1e-4, "rmsnorm dinp");
  // dweight accumulates onto what was there.
  for (auto& v : ref.dweight) v += 0.5;
  expect_close(dweight.data(), ref.dweight.data(), C, 1e-5, 1e-4, "rmsnorm dweight +=");

  std::vector<float> dw(C, 0.0f);
  rmsnorm_backward(dinp.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
  auto loss = [&] {
    std::vector<float> o(N * C), r(N);
    rmsnorm_forward(o.data(), r.data(), x.data(), w.data(), N, C, kEps);
    double s = 0;
    for (int64_t i = 0; i < N * C; ++i) s += double(o[i]) * dy[i];
    return s;
  };
  check_gradient(x.data(), dinp.data(), N * C, loss, "rmsnorm dinp (finite differences)");
  check_gradient(w.data(), dw.data(), C, loss, "rmsnorm dweight (finite differences)");
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormTest,
                         ::testing::Values(std::make_tuple(0, 5), std::make_tuple(1, 1),
                                           std::make_tuple(1, 8), std::make_tuple(7, 33),
                                           std::make_tuple(64, 257), std::make_tuple(5, 1)));

TEST(RmsNorm, DeterministicAcrossThreadCounts) {
  // Large enough to take the parallel paths, several column blocks, a ragged last block.
  const int64_t N = 300, C = 333;
  auto x = random_vector(N * C, 7), w = random_vector(C, 8), dy = random_vector(N * C, 9);
  std::vector<float> out1(N * C), dinp1(N * C), dw1(C, 0.25f);
  std::vector<float> out2(N * C), dinp2(N * C), dw2(C, 0.25f);
  run_norm(1, out1, dinp1, dw1, x, w, dy, N, C);
  run_norm(2, out2, dinp2, dw2, x, w, dy, N, C);
  EXPECT_TRUE(same_bits(out1.data(), out2.data(), N * C));
  EXPECT_TRUE(same_bits(dinp1.data(), dinp2.data(), N * C));
  EXPECT_TRUE(same_bits(dw1.data(), dw2.data(), C));
  auto ref = rmsnorm_ref(x, w, dy, N, C, kEps);
  for (auto& v : ref.dweight) v += 0.25;
  expect_close(dw2.data(), ref.dweight.data(), C, 1e-4, 1e-4, "rmsnorm dweight (2 threads)");
}

// The residual stream's adds fused into the norm (the transformer block's two joins) give the
// bits of the add and the norm in separate passes, on one thread and on two.
TEST(RmsNorm, FusedResidualAddsGiveTheSeparatePassesBits) {
  const int saved = omp_get_max_threads();
  for (const auto& [N, C] : {std::pair<int64_t, int64_t>{7, 33}, {300, 128}, {64, 257}}) {
    auto x = random_vector(N * C, 11), add = random_vector(N * C, 12), w = random_vector(C, 13),
         dy = random_vector(N * C, 14), res = random_vector(N * C, 15);
    // Separate: sum = x + add, out = rmsnorm(sum); dinp = backward, then += res.
    std::vector<float> sum(x), out(N * C), rstd(N), dinp(N * C), dw(C, 0.5f);
    for (int64_t i = 0; i < N * C; ++i) sum[i] += add[i];
    rmsnorm_forward(out.data(), rstd.data(), sum.data(), w.data(), N, C, kEps);
    rmsnorm_backward(dinp.data(), dw.data(), dy.data(), sum.data(), w.data(), rstd.data(), N, C);
    for (int64_t i = 0; i < N * C; ++i) dinp[i] += res[i];
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      std::vector<float> fsum(x), fout(N * C), frstd(N), fdinp(N * C), fdw(C, 0.5f);
      add_rmsnorm_forward(fout.data(), frstd.data(), fsum.data(), add.data(), w.data(), N, C,
                          kEps);
      rmsnorm_backward(fdinp.data(), fdw.data(), dy.data(), fsum.data(), w.data(), frstd.data(),
                       N, C, res.data());
      EXPECT_TRUE(same_bits(fsum.data(), sum.data(), N * C)) << N << "x" << C << ", " << threads;
      EXPECT_TRUE(same_bits(fout.data(), out.data(), N * C)) << N << "x" << C << ", " << threads;
      EXPECT_TRUE(same_bits(frstd.data(), rstd.data(), N)) << N << "x" << C << ", " << threads;
      EXPECT_TRUE(same_bits(fdinp.data(), dinp.data(), N * C)) << N << "x" << C << ", " << threads;
      EXPECT_TRUE(same_bits(fdw.data(), dw.data(), C)) << N << "x" << C << ", " << threads;
    }
  }
  omp_set_num_threads(saved);
}

TEST(RmsNorm, RejectsBadShapes) {
  float dummy = 0;
  EXPECT_THROW(rmsnorm_forward(&dummy, &dummy, &dummy, &dummy, 1, 0, kEps), moetrain::Error);
  EXPECT_THROW(rmsnorm_forward(&dummy, &dummy, &dummy, &dummy, -1, 4, kEps), moetrain::Error);
  EXPECT_THROW(rmsnorm_backward(&dummy, &dummy, &dummy, &dummy, &dummy, &dummy, 1, 0),
               moetrain::Error);
}
