#include "data/loader.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "core/profile.h"

namespace moetrain {

namespace {
void check_layout(const TokenShard& shard, int64_t B, int64_t T, int rank, int world,
                  const char* who) {
  MOETRAIN_CHECK(B >= 1 && T >= 1, "{}: batch B={} and sequence T={} must be at least 1", who, B,
                 T);
  MOETRAIN_CHECK(world >= 1 && rank >= 0 && rank < world, "{}: rank {} outside world of {}", who,
                 rank, world);
  MOETRAIN_CHECK(shard.size() >= static_cast<uint64_t>(T) + 1,
                 "{}: shard '{}' has {} tokens, fewer than one window of T+1 = {}", who,
                 shard.path().string(), shard.size(), T + 1);
}

// Window [start, start+T] as inputs and next-token targets.
inline void copy_window(const TokenShard& shard, uint64_t start, int64_t T, int32_t* in,
                        int32_t* tgt) {
  shard.read(start, T, in);
  shard.read(start + 1, T, tgt);
}
}  // namespace

WindowStream::WindowStream(const TokenShard& shard, int64_t T, uint64_t seed)
    : shard_(&shard),
      T_(T),
      sampler_(
          (check_layout(shard, 1, T, 0, 1, "WindowStream"), WindowStream::windows_in(shard, T)),
          seed) {}

// The windows of T+1 tokens at multiples of T (training and evaluation alike).
int64_t WindowStream::windows_in(const TokenShard& shard, int64_t T) {
  return T >= 1 && shard.size() > 0
             ? static_cast<int64_t>((shard.size() - 1) / static_cast<uint64_t>(T))
             : 0;
}

void WindowStream::read(int64_t position, int32_t* inputs, int32_t* targets) {
  copy_window(*shard_, window_start(position), T_, inputs, targets);
}

int64_t stream_position(int64_t step, int64_t micro, int64_t row, int64_t rows,
                        int64_t micro_batches) {
  MOETRAIN_CHECK(step >= 0 && micro >= 0 && micro < micro_batches && row >= 0 && row < rows,
                 "stream_position: step {}, micro-batch {} of {}, row {} of {}", step, micro,
                 micro_batches, row, rows);
  return (step * micro_batches + micro) * rows + row;
}

BatchLoader::BatchLoader(const TokenShard& shard, int64_t B, int64_t T, uint64_t seed, int rank,
                         int world, int64_t micro_batches)
    : stream_((check_layout(shard, B, T, rank, world, "BatchLoader"), shard), T, seed),
      B_(B),
      rank_(rank),
      world_(world),
      micro_batches_(micro_batches) {
  MOETRAIN_CHECK(micro_batches >= 1, "BatchLoader: {} micro-batches per step, needs at least 1",
                 micro_batches);
}

int64_t BatchLoader::position(int64_t step, int64_t micro, int64_t b) const {
  MOETRAIN_CHECK(step >= 0 && micro >= 0 && micro < micro_batches_ && b >= 0 && b < B_,
                 "BatchLoader: step {}, micro {} (of {}), row {} (B={})", step, micro,
                 micro_batches_, b, B_);
  return stream_position(step, micro, rank_ * B_ + b, world_ * B_, micro_batches_);
}

void BatchLoader::fill(int64_t step, int64_t micro, int32_t* inputs, int32_t* targets) {
  PhaseScope phase_scope(Phase::Data);
  const int64_t T = stream_.seq_len();
  for (int64_t b = 0; b < B_; ++b)
    stream_.read(position(step, micro, b), inputs + b * T, targets + b * T);
}

EvalLoader::EvalLoader(const TokenShard& shard, int64_t B, int64_t T, int64_t max_batches, int rank,
                       int world)
    : shard_(&shard), B_(B), T_(T), rank_(rank), world_(world) {
  check_layout(shard, B, T, rank, world, "EvalLoader");
  MOETRAIN_CHECK(max_batches >= 0, "EvalLoader: max_batches {} must be >= 0 (0 = all)",
                 max_batches);
  const int64_t per_batch = B * world;
  windows_ = WindowStream::windows_in(shard, T);
  if (max_batches > 0 && max_batches <= windows_ / per_batch) windows_ = max_batches * per_batch;
  batches_ = (windows_ + per_batch - 1) / per_batch;
}

int64_t EvalLoader::fill(int64_t i, int32_t* inputs, int32_t* targets) const {
  MOETRAIN_CHECK(i >= 0 && i < batches_, "EvalLoader: batch {} outside [0, {})", i, batches_);
  const int64_t first = (i * world_ + rank_) * B_;
  const int64_t rows = std::clamp<int64_t>(windows_ - first, 0, B_);
  for (int64_t b = 0; b < rows; ++b) {
    copy_window(*shard_, static_cast<uint64_t>((first + b) * T_), T_, inputs + b * T_, targets + b * T_);
  }
  const auto tail = static_cast<std::size_t>((B_ - rows) * T_);
  std::memset(inputs + rows * T_, 0, tail * sizeof(int32_t));
  std::memset(targets + rows * T_, 0, tail * sizeof(int32_t));
  return rows;
}

}  // namespace moetrain
