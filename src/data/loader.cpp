#include "data/loader.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "core/profile.h"
#include "core/rng.h"

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

BatchLoader::BatchLoader(const TokenShard& shard, int64_t B, int64_t T, uint64_t seed, int rank,
                         int world)
    : shard_(&shard), B_(B), T_(T), seed_(seed), rank_(rank), world_(world) {
  check_layout(shard, B, T, rank, world, "BatchLoader");
}

uint64_t BatchLoader::window_start(int64_t step, int64_t micro, int64_t b) const {
  MOETRAIN_CHECK(step >= 0 && micro >= 0 && b >= 0 && b < B_,
                 "BatchLoader: step {}, micro {}, row {} (B={})", step, micro, b, B_);
  const Rng rng(seed_, rng_stream(RngPurpose::Data, static_cast<uint64_t>(step), 0));
  const uint64_t row = (static_cast<uint64_t>(micro) * world_ + rank_) * B_ + b;
  return rng.below(row, shard_->size() - T_);
}

void BatchLoader::fill(int64_t step, int64_t micro, int32_t* inputs, int32_t* targets) const {
  PhaseScope phase_scope(Phase::Data);
  MOETRAIN_CHECK(step >= 0 && micro >= 0,
                 "BatchLoader: step {} and micro-batch {} must be non-negative", step, micro);
  for (int64_t b = 0; b < B_; ++b) {
    copy_window(*shard_, window_start(step, micro, b), T_, inputs + b * T_,
                targets + b * T_);
  }
}

EvalLoader::EvalLoader(const TokenShard& shard, int64_t B, int64_t T, int64_t max_batches, int rank,
                       int world)
    : shard_(&shard), B_(B), T_(T), rank_(rank), world_(world) {
  check_layout(shard, B, T, rank, world, "EvalLoader");
  MOETRAIN_CHECK(max_batches >= 0, "EvalLoader: max_batches {} must be >= 0 (0 = all)",
                 max_batches);
  const int64_t per_batch = B * world;
  windows_ = static_cast<int64_t>((shard.size() - 1) / static_cast<uint64_t>(T));
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
