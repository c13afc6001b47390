#include "ps/consistency.h"

#include <algorithm>
#include <climits>
#include <set>

#include "core/check.h"
#include "core/rng.h"

namespace moetrain::ps {

bool ConsistencyRules::is_active(int64_t worker) const {
  return std::binary_search(active_.begin(), active_.end(), worker);
}

void ConsistencyRules::set_active(std::vector<int64_t> workers) {
  std::sort(workers.begin(), workers.end());
  active_ = std::move(workers);
  for (auto it = clocks_.begin(); it != clocks_.end();)
    it = is_active(it->first) ? std::next(it) : clocks_.erase(it);
}

PushFate ConsistencyRules::push(int64_t worker, int64_t clock, int64_t id, int64_t group_size) {
  if (!is_active(worker)) return PushFate::NotActive;
  if (summed_per_clock()) {
    if (clock < version_) return PushFate::Late;
    MOETRAIN_CHECK(group_size >= 1, "a push from worker {} of a group of {} processes", worker,
                   group_size);
    sizes_[worker] = group_size;
    pending_[clock][worker] = id;
    return next_update_possible() ? PushFate::Ready : PushFate::Queued;
  }
  MOETRAIN_CHECK(group_size >= 1 && (group_size == 1 || group_size_ == 1 ||
                                     group_size == group_size_),
                 "a push from worker {} of a group of {}, where the job's groups have {} "
                 "processes: every worker group of a job must have the same size",
                 worker, group_size, group_size_);
  Update u;
  u.version = version_;
  u.clock = clock;
  u.group_size = group_size;
  if (group_size == 1) {
    u.ids = {id};
    u.workers = {worker};
  } else {
    // The group's parts wait for each other; the last one makes the update.
    group_size_ = group_size;
    const int64_t first = worker - worker % group_size;
    std::map<int64_t, int64_t>& got = parts_[{first, clock}];
    got[worker] = id;
    if (static_cast<int64_t>(got.size()) < group_size) return PushFate::Queued;
    for (const auto& [w, part] : got) {  // worker-index order
      u.ids.push_back(part);
      u.workers.push_back(w);
    }
    parts_.erase({first, clock});
  }
  for (int64_t w : u.workers) {
    int64_t& c = clocks_[w];
    c = std::max(c, clock + 1);
  }
  u.worker = u.workers.front();
  u.worker_clock = clocks_[u.worker];
  ready_ = std::move(u);
  return PushFate::Ready;
}

bool ConsistencyRules::next_update_possible() const {
  if (!summed_per_clock()) return ready_.has_value();
  auto it = pending_.find(version_);
  if (it == pending_.end() || active_.empty()) return false;
  const auto& got = it->second;
  if (cfg_.mode != Consistency::Quorum) {
    for (int64_t w : active_)
      if (!got.count(w)) return false;
    return true;
  }
  const int64_t q = std::min(cfg_.quorum, active_groups());
  return static_cast<int64_t>(whole_groups(got).size()) >= q;
}

int64_t ConsistencyRules::group_of(int64_t worker) const {
  const auto s = sizes_.find(worker);
  const int64_t size = s == sizes_.end() ? 1 : s->second;
  return worker - worker % size;
}

std::map<int64_t, int64_t> ConsistencyRules::whole_groups(
    const std::map<int64_t, int64_t>& got) const {
  std::map<int64_t, int64_t> parts;  // group's first worker → parts arrived
  for (const auto& [w, id] : got) ++parts[group_of(w)];
  std::map<int64_t, int64_t> out;
  for (const auto& [first, n] : parts) {
    // Every part of a group says the group's size; its first arrived part's does.
    const int64_t size = sizes_.at(got.lower_bound(first)->first);
    if (n == size) out[first] = size;
  }
  return out;
}

int64_t ConsistencyRules::active_groups() const {
  // A worker not heard from yet counts as a group of its own: before any push the cap is the
  // workers, which is never below the groups.
  std::vector<int64_t> firsts;
  for (int64_t w : active_) firsts.push_back(group_of(w));
  return static_cast<int64_t>(std::set<int64_t>(firsts.begin(), firsts.end()).size());
}

std::optional<Update> ConsistencyRules::next_update() {
  if (!next_update_possible()) return std::nullopt;
  if (!summed_per_clock()) {
    std::optional<Update> u = std::move(ready_);
    ready_.reset();
    return u;
  }
  const auto& got = pending_.at(version_);
  Update u;
  u.version = u.clock = version_;
  if (cfg_.mode != Consistency::Quorum) {
    for (int64_t w : active_) {
      u.ids.push_back(got.at(w));
      u.workers.push_back(w);
    }
  } else {
    // Every whole group's parts (a part of an incomplete group is left to be dropped with the
    // clock), in worker-index order.
    const std::map<int64_t, int64_t> whole = whole_groups(got);
    for (const auto& [w, id] : got) {  // std::map: worker-index order
      if (!whole.count(group_of(w))) continue;
      u.ids.push_back(id);
      u.workers.push_back(w);
    }
    for (const auto& [first, size] : whole) u.groups.push_back(first);
  }
  return u;
}

std::vector<int64_t> ConsistencyRules::applied(const Update& u) {
  MOETRAIN_CHECK(u.version == version_, "update of version {} applied at version {}", u.version,
                 version_);
  std::vector<int64_t> freed = u.ids;
  // A group's parts that wait for a rank no longer active will not be completed: its group died
  // (a rank that died takes its group down), and a restarted group pushes them again.
  for (auto it = parts_.begin(); it != parts_.end();) {
    bool lost = false;
    for (int64_t w = it->first.first; w < it->first.first + group_size_; ++w)
      lost = lost || !is_active(w);
    if (!lost) {
      ++it;
      continue;
    }
    for (const auto& [w, id] : it->second) freed.push_back(id);
    it = parts_.erase(it);
  }
  if (summed_per_clock()) {
    freed.clear();
    // What else is pending for this clock (a worker no longer active) is past too.
    const auto end = pending_.upper_bound(u.clock);
    for (auto it = pending_.begin(); it != end; ++it)
      for (const auto& [w, id] : it->second) freed.push_back(id);
    pending_.erase(pending_.begin(), end);
  }
  ++version_;
  return freed;
}

int64_t ConsistencyRules::schedule_step() const {
  // A group's pushes of a clock make one update.
  return summed_per_clock()
             ? version_
             : version_ / std::max<int64_t>(1, cfg_.workers_at_start / group_size_);
}

int64_t ConsistencyRules::min_clock(int64_t except) const {
  int64_t m = INT64_MAX;
  for (const auto& [w, c] : clocks_)
    if (w != except) m = std::min(m, c);
  return m;
}

bool ConsistencyRules::pull_ready(int64_t worker, int64_t clock) const {
  if (clock < 0) return true;
  // A worker alone reads after its own push applied (the push came first on its socket and
  // applied on arrival); a group's rank reads once its part did, with the group's other parts.
  for (const auto& [group_clock, got] : parts_)
    if (got.count(worker)) return false;
  switch (cfg_.mode) {
    case Consistency::Sync:
    case Consistency::Quorum:
    case Consistency::Average:
      return version_ >= clock;
    case Consistency::Async:
      return true;
    case Consistency::Ssp:
    case Consistency::HalfSync: {
      if (!is_active(worker)) return true;
      const int64_t m = min_clock(-1);
      return m == INT64_MAX || m >= clock - cfg_.staleness;
    }
  }
  return true;
}

int64_t ConsistencyRules::pull_answered(int64_t worker, int64_t clock) {
  if (summed_per_clock()) return version_;
  int64_t next = 0;
  if (auto c = clocks_.find(worker); c != clocks_.end()) {
    next = c->second;
  } else {
    const int64_t m = min_clock(worker);
    next = m == INT64_MAX ? 0 : m;
    if (is_active(worker)) clocks_[worker] = next;
  }
  if ((cfg_.mode == Consistency::Ssp || cfg_.mode == Consistency::HalfSync) && clock >= 0) {
    const int64_t m = min_clock(-1);
    if (m != INT64_MAX) max_staleness_ = std::max(max_staleness_, clock - m);
  }
  return next;
}

void ConsistencyRules::replayed(int64_t worker, int64_t worker_clock, int64_t group_size) {
  ++version_;
  if (group_size > 1) group_size_ = group_size;
  for (int64_t w = worker; worker >= 0 && w < worker + group_size; ++w)
    clocks_[w] = std::max(clocks_[w], worker_clock);
}

std::vector<int64_t> ConsistencyRules::restore(int64_t clock,
                                               std::map<int64_t, int64_t> worker_clocks) {
  std::vector<int64_t> freed;
  for (const auto& [c, got] : pending_)
    for (const auto& [w, id] : got) freed.push_back(id);
  if (ready_) freed.insert(freed.end(), ready_->ids.begin(), ready_->ids.end());
  for (const auto& [group_clock, got] : parts_)
    for (const auto& [w, id] : got) freed.push_back(id);
  parts_.clear();
  pending_.clear();
  ready_.reset();
  clocks_ = std::move(worker_clocks);
  version_ = clock;
  return freed;
}

SumResult sum_pushes(const std::vector<PushView>& in, int64_t n, float* out) {
  MOETRAIN_CHECK(!in.empty(), "an update with no pushes");
  const auto N = static_cast<std::size_t>(n);
  std::copy(in[0].grads, in[0].grads + N, out);
  int64_t rows = in[0].rows;
  double loss = in[0].loss * static_cast<double>(in[0].rows);
  for (std::size_t k = 1; k < in.size(); ++k) {
    const float* g = in[k].grads;
    for (std::size_t i = 0; i < N; ++i) out[i] += g[i];
    rows += in[k].rows;
    loss += in[k].loss * static_cast<double>(in[k].rows);
  }
  // Each worker weighted its gradient by its share of the global batch; when fewer rows than
  // the global batch arrived (a quorum, an async push, a worker lost mid-clock), rescale to the
  // mean over the rows that did.
  const int64_t global = in[0].global_rows;
  if (rows != global) {
    const float s = static_cast<float>(global) / static_cast<float>(rows);
    for (std::size_t i = 0; i < N; ++i) out[i] *= s;
  }
  return {rows, loss / static_cast<double>(rows)};
}

double half_sync_wait(uint64_t seed, int64_t worker, int64_t clock, double bound_ms) {
  // The counter-based generator's stream for (worker, clock): 53 random bits.
  const Rng rng(seed, rng_stream(RngPurpose::PsWait, static_cast<uint64_t>(clock),
                                 static_cast<uint64_t>(worker)));
  const uint64_t bits = (static_cast<uint64_t>(rng.u32(0)) << 21) ^ (rng.u32(1) >> 11);
  const double u = static_cast<double>(bits) * 0x1.0p-53;  // [0, 1)
  return u * bound_ms / 1000.0;
}

}  // namespace moetrain::ps
