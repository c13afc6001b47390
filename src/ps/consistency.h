// The consistency rules of a parameter server, as a pure state machine (no sockets, no model):
// which pushes an update sums and in which order, when it applies, what is dropped, and when a
// pull may be answered.
//   sync    every active worker's push for the clock, summed in worker-index order
//   quorum  the first q pushes for the clock (all that arrived once q did, in worker-index
//           order); later ones for an old clock are dropped, counted
//   async   each push on arrival
//   ssp     each push on arrival; a pull from a worker at clock c waits until the slowest active
//           worker has reached c − s
//   half_sync  ssp's rules on the servers; in addition each worker waits, at every clock between
//           its push and its pull, a random time up to a bound (half_sync_wait below), so the
//           pull more often sees the others' pushes of that clock
//   average sync's rules over pushes that carry parameters (each weighted by its rows' share of
//           the global batch): the sum is the row-weighted mean, which becomes the values
// A worker group (workers g·P … g·P + P − 1, each pushing a disjoint part of the keys) is one
// worker to async, ssp and half_sync: its P pushes of a clock make one update, summed in
// worker-index order, once the last of them arrived; every rank's clock moves with it. Quorum
// counts groups: a clock applies once q whole groups' parts (a worker alone is a whole group)
// arrived, with every whole group's parts and none of an incomplete one's, whose parts are then
// late together. (Sync and average sum them anyway, as every push of a clock.)
// The server (kv_server.h) names each push it queues by an id and holds its gradient; an Update
// lists the ids to sum, and every id the rules let go of is returned so the server frees it.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "ps/options.h"

namespace moetrain::ps {

// One update ready to apply: the pushes it sums, in this order.
struct Update {
  int64_t version = 0;           // the server's version before the update
  int64_t clock = 0;             // the clock the pushes were computed at (sync / quorum: version)
  std::vector<int64_t> ids;      // push ids, in worker-index order
  std::vector<int64_t> workers;  // the pushing workers, same order
  // async / ssp: the pushing worker (a group's first) and its clock after the push (what a
  // backup must record); sync / quorum: −1, 0.
  int64_t worker = -1, worker_clock = 0;
  int64_t group_size = 1;  // async / ssp: the pushing group's processes (1: a worker alone)
  // quorum: the whole groups (each named by its first worker) the update sums.
  std::vector<int64_t> groups;
};

enum class PushFate {
  Queued,     // waits for the other pushes of its clock (sync, quorum)
  Ready,      // an update can apply now (next_update())
  Late,       // sync / quorum: for a clock already applied; dropped
  NotActive,  // from a worker the job does not count now; dropped
};

struct ConsistencyConfig {
  Consistency mode = Consistency::Sync;
  int64_t quorum = 0;            // quorum: pushes that apply a clock
  int64_t staleness = 0;         // ssp, half_sync: how many clocks the fastest may lead the slowest
  int64_t workers_at_start = 1;  // async / ssp: pushes per global step of the lr schedule
};

class ConsistencyRules {
 public:
  explicit ConsistencyRules(const ConsistencyConfig& c = {}) : cfg_(c) {}

  const ConsistencyConfig& config() const { return cfg_; }
  int64_t version() const { return version_; }  // updates applied
  const std::vector<int64_t>& active() const { return active_; }
  bool is_active(int64_t worker) const;
  // async / ssp: worker → pushes done (its clock); a checkpoint keeps it.
  const std::map<int64_t, int64_t>& worker_clocks() const { return clocks_; }
  int64_t max_staleness() const { return max_staleness_; }
  // Pushes received and not yet applied (sync / quorum: of incomplete clocks).
  int64_t pending_pushes() const {
    int64_t n = ready_ ? 1 : 0;
    for (const auto& [clock, by_worker] : pending_) n += static_cast<int64_t>(by_worker.size());
    for (const auto& [group_clock, by_worker] : parts_) n += static_cast<int64_t>(by_worker.size());
    return n;
  }

  // The workers the job counts now (a worker lost, one joined). Clocks of workers no longer
  // active are forgotten; a sync clock may become complete (see next_update()).
  void set_active(std::vector<int64_t> workers);

  // A push of `worker` (of a group of `group_size`) at `clock`, held by the caller under `id`.
  // Late and NotActive pushes are not kept (the caller frees them).
  PushFate push(int64_t worker, int64_t clock, int64_t id, int64_t group_size = 1);

  // The next update that may apply, if any. The caller applies it, then calls applied(). An
  // async / ssp update is handed out once: if applying it fails, the push is lost (the caller
  // frees it), as a sync clock is not: its pushes stay pending.
  std::optional<Update> next_update();
  // The update is applied: the version advances. Returns the ids of pushes the caller may free
  // (those summed, and any others of clocks now past).
  std::vector<int64_t> applied(const Update& u);

  // The lr schedule's step for the update about to apply: async updates come one push at a
  // time, and the schedule advances once per global step.
  int64_t schedule_step() const;

  // Whether a pull from `worker` for `clock` may be answered now (clock < 0: a join or a final
  // read, answered at once; not while the worker's part of a group's update waits).
  bool pull_ready(int64_t worker, int64_t clock) const;
  // For an answered pull: the clock the worker should continue at. A worker the rules do not
  // know yet (async / ssp) starts level with the slowest, so it holds no one back.
  int64_t pull_answered(int64_t worker, int64_t clock);

  // A backup replays its primary's update: the version advances, and (async / ssp) the pushing
  // worker's clock (every rank's of its group) is raised to what the primary recorded.
  void replayed(int64_t worker, int64_t worker_clock, int64_t group_size = 1);

  // Back to `clock` with these worker clocks (a checkpoint); everything pending is dropped and
  // returned for freeing.
  std::vector<int64_t> restore(int64_t clock, std::map<int64_t, int64_t> worker_clocks);

 private:
  bool summed_per_clock() const { return !applies_per_push(cfg_.mode); }
  int64_t min_clock(int64_t except) const;
  bool next_update_possible() const;
  // quorum: the first worker of `worker`'s group (its group size from its pushes; a worker not
  // heard from is its own group).
  int64_t group_of(int64_t worker) const;
  // quorum: the groups (first worker → processes) whose every part of `got` arrived, and how
  // many groups the active workers make.
  std::map<int64_t, int64_t> whole_groups(const std::map<int64_t, int64_t>& got) const;
  int64_t active_groups() const;

  ConsistencyConfig cfg_;
  int64_t version_ = 0;
  std::vector<int64_t> active_;                            // sorted
  std::map<int64_t, std::map<int64_t, int64_t>> pending_;  // sync/quorum: clock → worker → id
  std::map<int64_t, int64_t> sizes_;  // quorum: worker → its group's processes, from its pushes
  std::optional<Update> ready_;                            // async/ssp: the push just arrived
  // async/ssp: a group's pushes of a clock so far, (group's first worker, clock) → worker → id
  std::map<std::pair<int64_t, int64_t>, std::map<int64_t, int64_t>> parts_;
  int64_t group_size_ = 1;  // async/ssp: the groups' size (pushes a global step takes fewer)
  std::map<int64_t, int64_t> clocks_;                      // async/ssp: worker → pushes done
  int64_t max_staleness_ = 0;
};

// The sum of the pushes of one update into out[0, n), in the given order (bit-exact order
// matters: float addition does not commute with regrouping), rescaled to the global batch when
// fewer rows arrived. Returns the rows that arrived and the row-weighted mean loss.
struct PushView {
  const float* grads = nullptr;  // (n)
  int64_t rows = 0, global_rows = 0;
  double loss = 0;
};
struct SumResult {
  int64_t rows = 0;
  double loss = 0;  // mean over the rows
};
SumResult sum_pushes(const std::vector<PushView>& in, int64_t n, float* out);

// half_sync: the wait of `worker` at `clock`, in seconds, uniform in [0, bound_ms / 1000): a
// function of (seed, worker, clock) alone (core/rng.h's counter-based generator), so a run
// and a worker restarted in its place wait the same times.
double half_sync_wait(uint64_t seed, int64_t worker, int64_t clock, double bound_ms);

}  // namespace moetrain::ps
