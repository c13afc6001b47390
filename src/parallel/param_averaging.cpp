#include "parallel/param_averaging.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/timer.h"

namespace moetrain {

ParamAverager::ParamAverager(const SyncRanges& ranges, Comm& dense, Comm& expert)
    : ranges_(ranges), dense_(dense), expert_(expert) {}

double ParamAverager::average(const std::vector<std::pair<float*, int64_t>>& parts,
                              Comm& comm) {
  const int P = comm.size();
  if (P == 1) return 0.0;
  int64_t n = 0;
  for (const auto& [p, size] : parts) n += size;
  packed_.resize(static_cast<std::size_t>(n));
  int64_t at = 0;
  for (const auto& [p, size] : parts) {
    std::memcpy(packed_.data() + at, p, static_cast<std::size_t>(size) * sizeof(float));
    at += size;
  }
  // All-reduce = reduce-scatter + all-gather: each rank sends (P − 1)/P of the values twice.
  bytes_sent_ += 2 * (n - n / P) * static_cast<int64_t>(sizeof(float));
  {
    ScopedTimer timer(seconds_);
    comm.allreduce(packed_.data(), n);
  }
  const float inv = 1.0f / static_cast<float>(P);
  double drift = 0.0;
  at = 0;
  for (const auto& [p, size] : parts) {
    for (int64_t i = 0; i < size; ++i) {
      const float mean = packed_[at + i] * inv;
      drift = std::max(drift, static_cast<double>(std::fabs(p[i] - mean)));
      p[i] = mean;
    }
    at += size;
  }
  return drift;
}

double ParamAverager::average_params(float* params) {
  std::vector<std::pair<float*, int64_t>> dense, expert;
  for (const FlatRange& r : ranges_.dense) dense.push_back({params + r.offset, r.size});
  for (const FlatRange& r : ranges_.expert) expert.push_back({params + r.offset, r.size});
  return std::max(average(dense, dense_), average(expert, expert_));
}

void ParamAverager::average_moments(ShardedOptimizer& optimizer) {
  auto is_expert = [&](const OptimPiece& piece) {
    return std::any_of(ranges_.expert.begin(), ranges_.expert.end(), [&](const FlatRange& r) {
      return piece.offset >= r.offset && piece.offset < r.offset + r.size;
    });
  };
  const std::vector<OptimPiece>& pieces = optimizer.pieces();
  for (int s = 0; s < static_cast<int>(optimizer.state_names().size()); ++s) {
    std::vector<std::pair<float*, int64_t>> dense, expert;
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const std::span<float> state = optimizer.piece_state(k, s);
      (is_expert(pieces[k]) ? expert : dense)
          .push_back({state.data(), static_cast<int64_t>(state.size())});
    }
    average(dense, dense_);
    average(expert, expert_);
  }
}

}  // namespace moetrain
