#include "parallel/zero3_params.h"

#include <algorithm>
#include <utility>

#include "core/check.h"
#include "core/page_buffer.h"
#include "core/profile.h"

namespace moetrain {

Zero3Params::Zero3Params(GradSync& sync, float* params, int64_t size,
                         std::vector<int64_t> unit_starts, CommThread* thread)
    : sync_(sync), params_(params), thread_(thread) {
  MOETRAIN_CHECK(!unit_starts.empty() && unit_starts.front() == 0 &&
                     std::is_sorted(unit_starts.begin(), unit_starts.end()) &&
                     unit_starts.back() < size,
                 "ZeRO-3: {} gather units over {} parameters, not ascending from 0",
                 unit_starts.size(), size);
  units_.resize(unit_starts.size());
  for (std::size_t u = 0; u < units_.size(); ++u) {
    const int64_t end = u + 1 < units_.size() ? unit_starts[u + 1] : size;
    units_[u].range = {unit_starts[u], end - unit_starts[u]};
  }
  auto unit_of = [&](int64_t x) {
    return static_cast<std::size_t>(
        std::upper_bound(unit_starts.begin(), unit_starts.end(), x) - unit_starts.begin() - 1);
  };
  const std::vector<GradSync::Bucket>& buckets = sync_.buckets();
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    const GradSync::Bucket& b = buckets[i];
    const std::size_t u = unit_of(b.pieces.front().offset);
    for (const FlatRange& p : b.pieces)
      MOETRAIN_CHECK(unit_of(p.offset) == u && unit_of(p.offset + p.size - 1) == u,
                     "ZeRO-3: gradient bucket {} spans two gather units", i);
    units_[u].buckets.push_back(i);
  }
  // What a released unit keeps: this rank's shard.
  std::vector<FlatRange> keep;
  for (const ShardPiece& p : sync_.shard_pieces()) keep.push_back(p.range);
  std::sort(keep.begin(), keep.end(),
            [](const FlatRange& a, const FlatRange& b) { return a.offset < b.offset; });
  for (std::size_t u = 0; u < units_.size(); ++u) {
    const int64_t lo = units_[u].range.offset, hi = lo + units_[u].range.size;
    int64_t at = lo;
    for (const FlatRange& k : keep) {
      if (k.offset + k.size <= lo || k.offset >= hi) continue;
      if (k.offset > at) units_[u].drop.push_back({at, k.offset - at});
      at = std::max(at, k.offset + k.size);
    }
    if (at < hi) units_[u].drop.push_back({at, hi - at});
  }
}

void Zero3Params::gather(int64_t u) {
  for (std::size_t i : units_[static_cast<std::size_t>(u)].buckets)
    sync_.allgather_bucket_params(params_, i);
}

void Zero3Params::post(int64_t u) {
  Unit& unit = units_[static_cast<std::size_t>(u)];
  if (unit.state != State::Released) return;
  if (thread_) {
    unit.ticket = thread_->post([this, u] { gather(u); });
    unit.state = State::Posted;
  } else {
    gather(u);
    unit.state = State::Present;
  }
}

void Zero3Params::acquire(int64_t unit, int64_t next) {
  MOETRAIN_CHECK(unit >= 0 && unit < units() && next >= -1 && next < units(),
                 "ZeRO-3: gather unit {} (then {}) of {}", unit, next, units());
  // A forward begins: units an earlier forward left in place (one without a backward) go.
  if (unit == 0)
    for (int64_t u = 1; u < units(); ++u)
      if (units_[static_cast<std::size_t>(u)].state == State::Present && u != next) release(u);
  PhaseScope phase_scope(Phase::ParamGather);
  post(unit);
  Unit& u = units_[static_cast<std::size_t>(unit)];
  if (u.state == State::Posted) thread_->wait(u.ticket);
  u.state = State::Present;
  if (next >= 0) post(next);
}

void Zero3Params::drop(int64_t u) {
  for (const FlatRange& r : units_[static_cast<std::size_t>(u)].drop)
    release_whole_pages(params_ + r.offset, r.size * static_cast<int64_t>(sizeof(float)));
}

void Zero3Params::release(int64_t unit) {
  Unit& u = units_[static_cast<std::size_t>(unit)];
  // A prefetched gather still writes the unit: it lands first.
  if (u.state == State::Posted) thread_->wait(u.ticket);
  drop(unit);  // also when this rank wrote the unit itself (its initialisation)
  u.state = State::Released;
}

void Zero3Params::acquire_all() {
  for (int64_t u = 0; u < units(); ++u) post(u);
  if (thread_) thread_->drain();
  for (Unit& u : units_) u.state = State::Present;
}

void Zero3Params::release_all() {
  if (thread_) thread_->drain();
  for (int64_t u = 0; u < units(); ++u) {
    drop(u);
    units_[static_cast<std::size_t>(u)].state = State::Released;
  }
}

}  // namespace moetrain
