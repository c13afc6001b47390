// Collective registry, watchdog and collective fingerprints.
//
// Open MPI 4.1 cannot repair a communicator: when a peer dies or stalls, the other ranks wait in
// their collective forever. Every collective of the MPI backend registers here for its duration
// (communicator, sequence number on that communicator, kind, bytes, start time), so that:
//   - a watchdog thread can warn when one has waited dist.collective_warn seconds and, after
//     dist.collective_timeout, name it and abort the job (MPI_Abort) for the supervisor
//     (`moetrain launch`) to restart from the last complete checkpoint;
//   - with --debug-collectives, the ranks of a communicator first exchange a fingerprint of the
//     call (sequence, kind, operation, element size, the sizes that must agree), so that a rank
//     issuing a different collective (one skipping an all-to-all, say) fails at once with both
//     sides named instead of hanging or mixing up messages.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/comm.h"

namespace moetrain {

// The byte primitives of a backend (core/comm.h), the unit the registry sees.
enum class CollectiveKind : int32_t {
  Barrier,
  Alltoallv,
  AlltoallvBlocks,
  Allgatherv,
  Broadcast,
  Split,
  Dup,
  SplitShared,
  Send,  // a point-to-point transfer's wait (Comm::isend / irecv): peer and tag in the entry
  Recv
};
const char* collective_kind_name(CollectiveKind kind);

// What the ranks of one collective must agree on. `agree` carries sizes every rank passes
// identically (a broadcast's bytes and root, an all-gather's count list), hashed; per-peer
// all-to-all counts are checked pairwise after the fingerprints match.
struct CollectiveFingerprint {
  int64_t seq = 0;
  int32_t kind = 0;  // CollectiveKind
  int32_t op = 0;    // CollectiveOp
  int64_t elem_size = 0;
  int64_t agree = 0;
};

// A collective in flight on this process.
struct ActiveCollective {
  std::string comm;
  int rank = 0;  // this process's rank in `comm`
  int64_t seq = 0;
  CollectiveKind kind = CollectiveKind::Barrier;
  CollectiveOp op = CollectiveOp::None;
  int64_t elem_size = 0;
  int64_t bytes = 0;
  int peer = -1;       // Send, Recv: the other rank in `comm` (the tag is in `seq`)
  double seconds = 0;  // waited so far
};

// "alltoallv #12 (allreduce, 4-byte elements) on communicator 'grads' (rank 1), 4096 bytes";
// "recv from rank 0 (tag 3) on communicator 'pipe' (rank 1), 4096 bytes".
std::string describe_collective(const ActiveCollective& c);

// Registers a collective for its lifetime; the fingerprint of the call is `fingerprint()`. A
// point-to-point wait registers as kind Send or Recv with its `peer`, its tag as `seq`.
class CollectiveScope {
 public:
  CollectiveScope(const std::string& comm, int rank, int64_t seq, CollectiveKind kind,
                  int64_t bytes, int64_t agree = 0, int peer = -1);
  ~CollectiveScope();
  CollectiveScope(const CollectiveScope&) = delete;
  CollectiveScope& operator=(const CollectiveScope&) = delete;

  const CollectiveFingerprint& fingerprint() const { return fp_; }

 private:
  uint64_t id_;
  CollectiveFingerprint fp_;
};

// Snapshot of the collectives in flight, oldest first.
std::vector<ActiveCollective> active_collectives();

// An empty string when every rank's fingerprint equals `all[rank]`; else the message naming this
// rank's call and the first rank whose call differs.
std::string fingerprint_mismatch(std::span<const CollectiveFingerprint> all, int rank,
                                 const std::string& comm);

// Process-wide switch for the fingerprint exchange; every rank must set the same value at the
// same point of the program (it is read at each collective).
void set_debug_collectives(bool on);
bool debug_collectives();

// A hash of a list of sizes (FNV-1a over the values), for CollectiveFingerprint::agree.
int64_t hash_sizes(std::span<const int64_t> values);

// Exit code of a job the watchdog aborted: the supervisor reports it as a collective timeout.
inline constexpr int kCollectiveTimeoutExit = 75;

struct WatchdogSettings {
  double warn_s = 60;      // 0: no warning
  double timeout_s = 300;  // 0: never abort
};

// The watchdog thread. It checks the registry a few times per warning period; `on_timeout`
// receives the message naming the stuck collective (default: print it on every rank and abort the
// job with kCollectiveTimeoutExit). A timed-out collective is reported once.
class CollectiveWatchdog {
 public:
  using Handler = std::function<void(const std::string& message)>;
  explicit CollectiveWatchdog(WatchdogSettings settings, Handler on_timeout = {});
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

 private:
  void loop();
  void check();

  WatchdogSettings settings_;
  Handler on_timeout_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace moetrain
