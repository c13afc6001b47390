#include "kernels/embedding.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/profile.h"

namespace moetrain {

namespace {
constexpr int64_t kParallelMin = 1 << 14;

void check_args(const char* fn, const int32_t* ids, int64_t N, int64_t C, int64_t V) {
  MOETRAIN_CHECK(N >= 0 && C >= 0 && V > 0, "{}: need N >= 0, C >= 0, V > 0, got N={} C={} V={}",
                 fn, N, C, V);
  for (int64_t n = 0; n < N; ++n) {
    MOETRAIN_CHECK(ids[n] >= 0 && ids[n] < V,
                   "{}: token id at position {} is {}, expected an id in [0, {})", fn, n, ids[n],
                   V);
  }
}
}  // namespace

void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                       int64_t V) {
  PhaseScope phase_scope(Phase::Embedding);
  check_args("embedding_forward", ids, N, C, V);
  if (C == 0) return;
#pragma omp parallel for schedule(static) if (N * C > kParallelMin)
  for (int64_t n = 0; n < N; ++n) std::memcpy(out + n * C, table + ids[n] * C, sizeof(float) * C);
}

void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C,
                        int64_t V) {
  PhaseScope phase_scope(Phase::Embedding);
  check_args("embedding_backward", ids, N, C, V);
  if (N == 0 || C == 0) return;
  // Group token positions by id, keeping token order inside a group; each group then owns its
  // table row, so groups run in parallel without races and each sums in token order. Where the
  // vocabulary is not much larger than the batch, by counting (one pass over the ids, one over
  // the vocabulary), else by a stable sort: the same groups in the same order either way.
  std::vector<int64_t> order(N);
  std::vector<int64_t> starts;
  starts.reserve(N + 1);
  if (V <= 4 * N) {
    std::vector<int64_t> next(static_cast<std::size_t>(V) + 1, 0);
    for (int64_t i = 0; i < N; ++i) ++next[ids[i] + 1];
    for (int64_t v = 0; v < V; ++v) {
      if (next[v + 1] > 0) starts.push_back(next[v]);
      next[v + 1] += next[v];
    }
    for (int64_t i = 0; i < N; ++i) order[next[ids[i]]++] = i;
  } else {
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
    for (int64_t i = 0; i < N; ++i) {
      if (i == 0 || ids[order[i]] != ids[order[i - 1]]) starts.push_back(i);
    }
  }
  starts.push_back(N);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  // Dynamic: a frequent token (padding, a common word) makes one group far larger than the rest.
#pragma omp parallel for schedule(dynamic, 16) if (N * C > kParallelMin && groups > 1)
  for (int64_t g = 0; g < groups; ++g) {
    float* row = dtable + int64_t{ids[order[starts[g]]]} * C;
    for (int64_t i = starts[g]; i < starts[g + 1]; ++i) {
      const float* d = dout + order[i] * C;
      for (int64_t c = 0; c < C; ++c) row[c] += d[c];
    }
  }
}

}  // namespace moetrain
