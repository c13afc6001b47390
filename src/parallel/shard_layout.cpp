// What GradSync's layout gives the rest of the engine: the ranges a rank reduces, and the pieces
// of its shard (grad_sync.h).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel/grad_sync.h"

namespace moetrain {

namespace {

// Sorted, adjacent ranges joined.
std::vector<FlatRange> merged(std::vector<FlatRange> v) {
  std::sort(v.begin(), v.end(),
            [](const FlatRange& a, const FlatRange& b) { return a.offset < b.offset; });
  std::vector<FlatRange> out;
  for (const FlatRange& r : v) {
    if (r.size == 0) continue;
    if (!out.empty() && out.back().offset + out.back().size == r.offset) {
      out.back().size += r.size;
    } else {
      out.push_back(r);
    }
  }
  return out;
}

}  // namespace

SyncRanges sync_ranges(const ParamTable& layout, const ExpertShard& shard) {
  std::vector<FlatRange> all_experts, own;
  SyncRanges out;
  const std::vector<ExpertPiece> keyed = expert_pieces(layout);
  std::size_t k = 0;
  for (const ParamInfo& p : layout.params()) {
    if (p.expert < 0) continue;
    all_experts.push_back({p.offset, p.numel});
    const ExpertPiece& piece = keyed[k++];
    if (p.expert >= shard.first && p.expert < shard.first + shard.count) {
      own.push_back({p.offset, p.numel});
      out.expert_keyed.push_back(piece);
    }
  }
  out.expert = merged(own);
  int64_t at = 0;
  for (const FlatRange& r : merged(all_experts)) {
    if (r.offset > at) out.dense.push_back({at, r.offset - at});
    at = r.offset + r.size;
  }
  if (layout.size() > at) out.dense.push_back({at, layout.size() - at});
  return out;
}

std::vector<GradSync::ShardSpan> GradSync::shard_spans() const {
  std::vector<ShardSpan> out;
  for_each_shard_piece([&](int64_t flat, int64_t at, int64_t n) {
    if (!out.empty() && out.back().flat + out.back().size == flat &&
        out.back().at + out.back().size == at) {
      out.back().size += n;
    } else {
      out.push_back({flat, at, n});
    }
  });
  return out;
}

std::vector<ShardPiece> GradSync::shard_pieces() const {
  std::vector<FlatRange> dense, expert;
  for (const Bucket& b : buckets_) {
    const int64_t lo = b.chunk_begin, hi = lo + b.counts[group(b).rank()];
    int64_t pos = 0;
    for (const FlatRange& p : b.pieces) {
      const int64_t a = std::max(lo, pos), z = std::min(hi, pos + p.size);
      if (a < z) (b.expert ? expert : dense).push_back({p.offset + (a - pos), z - a});
      pos += p.size;
    }
  }
  std::vector<ShardPiece> out;
  for (const FlatRange& r : merged(dense)) out.push_back({r, false});
  for (const FlatRange& r : merged(expert)) out.push_back({r, true});
  std::sort(out.begin(), out.end(), [](const ShardPiece& a, const ShardPiece& b) {
    return a.range.offset < b.range.offset;
  });
  return out;
}

}  // namespace moetrain
