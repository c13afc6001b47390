#include "parallel/zero2_reducer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/check.h"
#include "core/timer.h"

namespace moetrain {

Zero2Reducer::Zero2Reducer(std::unique_ptr<GradSync> sync, CommThread* overlap, PageBuffer& grads,
                           bool sharded_params)
    : sync_(std::move(sync)), overlap_(overlap), grads_(grads), sharded_params_(sharded_params) {
  for (const GradSync::Bucket& b : sync_->buckets()) {
    std::vector<FlatRange> r = b.pieces;
    std::sort(r.begin(), r.end(),
              [](const FlatRange& x, const FlatRange& y) { return x.offset < y.offset; });
    std::vector<FlatRange> joined;
    for (const FlatRange& p : r) {
      if (!joined.empty() && joined.back().offset + joined.back().size == p.offset) {
        joined.back().size += p.size;
      } else if (p.size > 0) {
        joined.push_back(p);
      }
    }
    ranges_.push_back(std::move(joined));
  }
  for (const GradSync::ShardSpan& s : sync_->shard_spans()) {
    pieces_.push_back({s.flat, s.size});
    piece_grads_.push_back(sync_->shard_data() + s.at);
  }
  sync_->set_bucket_done([this](std::size_t i) { bucket_done(i); });
}

void Zero2Reducer::bucket_done(std::size_t i) {
  const std::span<float> chunk = sync_->shard_chunk(i);
  float* acc = acc_.data() + (chunk.data() - sync_->shard_data());
  const std::size_t n = chunk.size();
  switch (fold_) {
    case Fold::None:
      break;
    case Fold::Start:
      std::memcpy(acc, chunk.data(), n * sizeof(float));
      break;
    case Fold::Add:
      for (std::size_t e = 0; e < n; ++e) acc[e] += chunk[e];
      break;
    case Fold::Finish:
      for (std::size_t e = 0; e < n; ++e) chunk[e] += acc[e];
      break;
  }
  // Backward writes below this bucket only now: its flat gradients are read no more.
  for (const FlatRange& r : ranges_[i]) released_ += grads_.clear(r.offset, r.size);
}

void Zero2Reducer::run(float* grads) {
  ScopedTimer timer(inline_s_);
  sync_->reduce_scatter(grads);
}

void Zero2Reducer::begin_micro_batch(float* grads, int64_t micro) {
  MOETRAIN_CHECK(grads == grads_.data(), "ZeRO-2 reduces its own gradient buffer only");
  if (micro == 0) accumulated_ = 0;
  if (acc_.empty()) acc_.assign(static_cast<std::size_t>(sync_->shard_size()), 0.0f);
  fold_ = accumulated_ == 0 ? Fold::Start : Fold::Add;
  if (overlap_) sync_->begin(*overlap_, grads, /*gather=*/false);
}

void Zero2Reducer::end_micro_batch(float* grads) {
  if (overlap_) {
    sync_->finish();
  } else {
    run(grads);
  }
  ++accumulated_;
}

void Zero2Reducer::begin(float* grads) {
  MOETRAIN_CHECK(grads == grads_.data(), "ZeRO-2 reduces its own gradient buffer only");
  fold_ = accumulated_ > 0 ? Fold::Finish : Fold::None;
  if (overlap_) sync_->begin(*overlap_, grads, /*gather=*/false);
}

GradientShard& Zero2Reducer::reduce(float* grads) {
  if (overlap_) {
    sync_->finish();
  } else {
    run(grads);
  }
  accumulated_ = 0;
  fold_ = Fold::None;
  return *sync_;
}

void Zero2Reducer::finish_step(float* params) {
  if (sharded_params_) {
    // ZeRO-3: the parameters are gathered unit by unit where the model uses them. The reduced
    // shard is read no more this step: its pages go until the next backward (a checkpoint's
    // gathers in between find the memory free).
    sync_->release_shard();
    return;
  }
  ScopedTimer timer(inline_s_);
  sync_->allgather_params(params);
}

}  // namespace moetrain
