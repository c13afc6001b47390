#include "parallel/watchdog.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>

#include "core/check.h"
#include "core/log.h"
#include "parallel/runtime.h"

namespace moetrain {

const char* collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::Barrier:
      return "barrier";
    case CollectiveKind::Alltoallv:
      return "alltoallv";
    case CollectiveKind::AlltoallvBlocks:
      return "alltoallv_blocks";
    case CollectiveKind::Allgatherv:
      return "allgatherv";
    case CollectiveKind::Broadcast:
      return "broadcast";
    case CollectiveKind::Split:
      return "split";
    case CollectiveKind::Dup:
      return "dup";
    case CollectiveKind::SplitShared:
      return "split_shared";
    case CollectiveKind::Send:
      return "send";
    case CollectiveKind::Recv:
      return "recv";
  }
  return "unknown collective";
}

namespace {

std::atomic<bool> g_debug{false};

using Clock = std::chrono::steady_clock;

struct Entry {
  uint64_t id;
  ActiveCollective info;
  Clock::time_point start;
  bool warned = false, timed_out = false;
};

struct Registry {
  std::mutex mutex;
  std::vector<Entry> entries;  // in start order
  uint64_t next_id = 1;
};

Registry& registry() {
  static Registry r;
  return r;
}

// "alltoallv #12 (in allreduce of 4-byte elements)"
std::string call_name(CollectiveKind kind, int64_t seq, CollectiveOp op, int64_t elem_size) {
  std::string s = fmt::format("{} #{}", collective_kind_name(kind), seq);
  if (op != CollectiveOp::None)
    s += fmt::format(" (in {} of {}-byte elements)", collective_op_name(op), elem_size);
  return s;
}

std::string describe_fingerprint(const CollectiveFingerprint& f) {
  return call_name(static_cast<CollectiveKind>(f.kind), f.seq, static_cast<CollectiveOp>(f.op),
                   f.elem_size);
}

}  // namespace

std::string describe_collective(const ActiveCollective& c) {
  if (c.kind == CollectiveKind::Send || c.kind == CollectiveKind::Recv)
    return fmt::format("{} {} rank {} (tag {}) on communicator '{}' (rank {}), {} bytes",
                       collective_kind_name(c.kind), c.kind == CollectiveKind::Send ? "to" : "from",
                       c.peer, c.seq, c.comm, c.rank, c.bytes);
  return call_name(c.kind, c.seq, c.op, c.elem_size) +
         fmt::format(" on communicator '{}' (rank {}), {} bytes", c.comm, c.rank, c.bytes);
}

CollectiveScope::CollectiveScope(const std::string& comm, int rank, int64_t seq,
                                 CollectiveKind kind, int64_t bytes, int64_t agree, int peer) {
  fp_.seq = seq;
  fp_.kind = static_cast<int32_t>(kind);
  fp_.op = static_cast<int32_t>(current_collective_op(&fp_.elem_size));
  fp_.agree = agree;
  Registry& r = registry();
  Entry e;
  e.info.comm = comm;
  e.info.rank = rank;
  e.info.seq = seq;
  e.info.kind = kind;
  e.info.op = current_collective_op(&e.info.elem_size);
  e.info.bytes = bytes;
  e.info.peer = peer;
  e.start = Clock::now();
  std::lock_guard<std::mutex> lock(r.mutex);
  id_ = e.id = r.next_id++;
  r.entries.push_back(std::move(e));
}

CollectiveScope::~CollectiveScope() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = std::find_if(r.entries.begin(), r.entries.end(),
                         [this](const Entry& e) { return e.id == id_; });
  if (it != r.entries.end()) r.entries.erase(it);
}

std::vector<ActiveCollective> active_collectives() {
  Registry& r = registry();
  const auto now = Clock::now();
  std::vector<ActiveCollective> out;
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const Entry& e : r.entries) {
    out.push_back(e.info);
    out.back().seconds = std::chrono::duration<double>(now - e.start).count();
  }
  return out;
}

std::string fingerprint_mismatch(std::span<const CollectiveFingerprint> all, int rank,
                                 const std::string& comm) {
  MOETRAIN_CHECK(rank >= 0 && rank < static_cast<int>(all.size()),
                 "fingerprint check on '{}': rank {} outside [0, {})", comm, rank, all.size());
  const CollectiveFingerprint& mine = all[rank];
  for (std::size_t q = 0; q < all.size(); ++q) {
    const CollectiveFingerprint& other = all[q];
    const bool same_call = other.seq == mine.seq && other.kind == mine.kind &&
                           other.op == mine.op && other.elem_size == mine.elem_size;
    if (same_call && other.agree == mine.agree) continue;
    std::string why = same_call ? " with different sizes (count, bytes or root)" : "";
    return fmt::format(
        "collective mismatch on communicator '{}': rank {} calls {} but rank {} calls {}{}; the "
        "ranks no longer issue the same collectives in the same order",
        comm, rank, describe_fingerprint(mine), q, describe_fingerprint(other), why);
  }
  return "";
}

void set_debug_collectives(bool on) {
  g_debug = on;
}
bool debug_collectives() {
  return g_debug.load(std::memory_order_relaxed);
}

int64_t hash_sizes(std::span<const int64_t> values) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t v : values) {
    for (int b = 0; b < 8; ++b)
      h = (h ^ ((static_cast<uint64_t>(v) >> (8 * b)) & 0xff)) * 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 1);
}

CollectiveWatchdog::CollectiveWatchdog(WatchdogSettings settings, Handler on_timeout)
    : settings_(settings), on_timeout_(std::move(on_timeout)) {
  MOETRAIN_CHECK(settings_.warn_s >= 0 && settings_.timeout_s >= 0,
                 "collective watchdog: warn {} s and timeout {} s must be ≥ 0 (0 = off)",
                 settings_.warn_s, settings_.timeout_s);
  if (!on_timeout_) {
    on_timeout_ = [](const std::string& message) {
      log_error("{}", message);
      std::fflush(stderr);
      // MPI_Abort from this thread may find MPI busy in the stuck call; if the job is not gone
      // soon, leaving without finalising makes the launcher end it anyway.
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::seconds(10));
        ::_exit(kCollectiveTimeoutExit);
      }).detach();
      dist_abort(kCollectiveTimeoutExit);
    };
  }
  thread_ = std::thread([this] { loop(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void CollectiveWatchdog::loop() {
  double shortest = 1.0;
  for (double s : {settings_.warn_s, settings_.timeout_s})
    if (s > 0) shortest = std::min(shortest, s);
  // A few checks per period: an abort lands within about a quarter period of the timeout.
  const auto period = std::chrono::duration<double>(std::clamp(shortest / 4, 0.01, 0.5));
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    wake_.wait_for(lock, period);
    if (stop_) break;
    lock.unlock();
    check();
    lock.lock();
  }
}

void CollectiveWatchdog::check() {
  Registry& r = registry();
  const auto now = Clock::now();
  std::vector<std::string> warnings, timeouts;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    for (Entry& e : r.entries) {
      const double waited = std::chrono::duration<double>(now - e.start).count();
      ActiveCollective c = e.info;
      c.seconds = waited;
      if (settings_.timeout_s > 0 && waited >= settings_.timeout_s && !e.timed_out) {
        e.timed_out = true;
        timeouts.push_back(fmt::format(
            "collective watchdog: {} has not completed after {:.1f} s "
            "(dist.collective_timeout = {} s): a peer process is dead or stalled; aborting the "
            "job so that it can be restarted from its last complete checkpoint",
            describe_collective(c), waited, settings_.timeout_s));
      } else if (settings_.warn_s > 0 && waited >= settings_.warn_s && !e.warned &&
                 (settings_.timeout_s == 0 || settings_.warn_s < settings_.timeout_s)) {
        e.warned = true;
        warnings.push_back(fmt::format(
            "collective watchdog: {} has waited {:.1f} s (dist.collective_warn = {} s; the job is "
            "aborted after dist.collective_timeout = {} s)",
            describe_collective(c), waited, settings_.warn_s, settings_.timeout_s));
      }
    }
  }
  for (const auto& w : warnings) log_message(LogLevel::Warn, true, w);
  for (const auto& t : timeouts) on_timeout_(t);
}

}  // namespace moetrain
