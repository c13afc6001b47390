#include <gtest/gtest.h>
#include <omp.h>

#include <cstring>
#include <functional>
#include <string>
#include <tuple>

#include "core/check.h"
#include "kernels/embedding.h"
#include "support/expect_error.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {
// Bitwise equality (memcmp would be handed null pointers for empty buffers).
bool same_bits(const float* a, const float* b, int64_t n) {
  return n == 0 || std::memcmp(a, b, sizeof(float) * n) == 0;
}
// Ids with many repeats (and the extremes 0 and V−1) so the backward accumulates.
std::vector<int32_t> make_ids(int64_t N, int64_t V, uint64_t seed) {
  std::vector<int32_t> ids(N);
  Rng rng(seed, rng_stream(RngPurpose::Test, 1, 0));
  for (int64_t n = 0; n < N; ++n) ids[n] = static_cast<int32_t>(rng.below(n, V));
  if (N > 1) ids[0] = 0, ids[N - 1] = static_cast<int32_t>(V - 1);
  return ids;
}

}  // namespace

class EmbeddingTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t>> {};

TEST_P(EmbeddingTest, ForwardBackward) {
  const auto [N, C, V] = GetParam();
  auto table = random_vector(V * C, 1), dout = random_vector(N * C, 2);
  auto ids = make_ids(N, V, 3);
  std::vector<float> out(N * C, -5.0f);
  embedding_forward(out.data(), ids.data(), table.data(), N, C, V);
  for (int64_t n = 0; n < N; ++n) {
    ASSERT_TRUE(same_bits(out.data() + n * C, table.data() + ids[n] * C, C)) << "token " << n;
  }

  std::vector<float> dtable(V * C, 0.5f);
  embedding_backward(dtable.data(), dout.data(), ids.data(), N, C, V);
  std::vector<double> ref(V * C, 0.5);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) ref[ids[n] * C + c] += dout[n * C + c];
  }
  expect_close(dtable.data(), ref.data(), V * C, 1e-6, 1e-6, "embedding dtable +=");

  std::vector<float> grad(V * C, 0.0f);
  embedding_backward(grad.data(), dout.data(), ids.data(), N, C, V);
  auto loss = [&] {
    std::vector<float> o(N * C);
    embedding_forward(o.data(), ids.data(), table.data(), N, C, V);
    double s = 0;
    for (int64_t i = 0; i < N * C; ++i) s += double(o[i]) * dout[i];
    return s;
  };
  check_gradient(table.data(), grad.data(), V * C, loss, "embedding dtable (finite differences)");
}

INSTANTIATE_TEST_SUITE_P(Shapes, EmbeddingTest,
                         ::testing::Values(std::make_tuple(0, 4, 3), std::make_tuple(1, 1, 1),
                                           std::make_tuple(1, 8, 5), std::make_tuple(7, 33, 5),
                                           std::make_tuple(64, 257, 50), std::make_tuple(500, 3, 2),
                                           std::make_tuple(5, 0, 4)));

TEST(Embedding, BackwardDeterministicAcrossThreadCounts) {
  // Past the parallel threshold, with ids repeating dozens of times.
  const int64_t N = 2000, C = 40, V = 37;
  auto dout = random_vector(N * C, 4, 10.0f);
  auto ids = make_ids(N, V, 5);
  // The bits a plain serial loop in token order produces.
  std::vector<float> serial(V * C, 0.125f);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) serial[ids[n] * C + c] += dout[n * C + c];
  }
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    std::vector<float> dtable(V * C, 0.125f);
    embedding_backward(dtable.data(), dout.data(), ids.data(), N, C, V);
    EXPECT_TRUE(same_bits(dtable.data(), serial.data(), V * C)) << threads << " threads";
  }
  omp_set_num_threads(saved);
}

TEST(Embedding, RejectsBadIds) {
  const int64_t N = 5, C = 3, V = 7;
  auto table = random_vector(V * C, 6), dout = random_vector(N * C, 7);
  std::vector<float> out(N * C), dtable(V * C);
  std::vector<int32_t> ids = {0, 6, 3, 7, 1};
  expect_error([&] { embedding_forward(out.data(), ids.data(), table.data(), N, C, V); },
               {"position 3", "is 7", "[0, 7)"});
  expect_error([&] { embedding_backward(dtable.data(), dout.data(), ids.data(), N, C, V); },
               {"position 3", "is 7", "[0, 7)"});
  ids = {0, 1, -1, 2, 3};
  expect_error([&] { embedding_forward(out.data(), ids.data(), table.data(), N, C, V); },
               {"position 2", "is -1"});
  // The table is untouched by a rejected backward.
  for (float v : dtable) EXPECT_EQ(v, 0.0f);
}
