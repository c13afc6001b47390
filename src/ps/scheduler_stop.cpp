// The scheduler's side of a requested stop (SIGINT / SIGTERM to the scheduler, or to `ps launch`):
// the workers finish their clock and pause, every primary server checkpoints its range, and once
// all of them stand at one clock the job shuts down naming it, so that `--resume` goes on from
// there.
#include <algorithm>
#include <climits>

#include "core/log.h"
#include "ps/job_plan.h"
#include "ps/scheduler_state.h"

namespace moetrain::ps {

// A stop, step 1: every worker finishes the clock it is in and waits (the RowsQuery of a
// rebalance, whose answer is never sent).
void Scheduler::begin_stop(int signal) {
  stop_ = Stop::Pausing;
  stop_signal_ = signal;
  stop_started_ = Clock::now();
  rows_query_.reset();
  paused_.clear();
  log_warn("ps scheduler: signal {}: the workers finish their clock, then every server "
           "checkpoints (a second signal stops at once)",
           signal);
  for (Node* w : members_.alive_workers())
    send_to(router_, w->identity, json_frame(Kind::RowsQuery, -1, {{"query", 2 * epoch_ + 1}}));
}

// Steps 2 and 3: once the workers paused (or after 30 s), every primary checkpoints its range
// and says at which clock; asked again until all stand at the same one in two rounds in a row
// (their last pushes may still be arriving), for up to 30 s. Returns true when the job has
// stopped.
bool Scheduler::advance_stop() {
  if (stop_ == Stop::Pausing) {
    bool all = true;
    for (Node* w : members_.alive_workers()) all = all && paused_.count(w->id) > 0;
    if (!all && since(stop_started_) < 30) return false;
    if (!all) log_warn("ps scheduler: not every worker paused within 30 s; checkpointing anyway");
    stop_ = Stop::Checkpointing;
    stop_started_ = Clock::now();
    stop_versions_.clear();
    stop_agreed_ = -1;
  }
  const int64_t S = args_.options.servers;
  if (static_cast<int64_t>(stop_versions_.size()) == S) {
    int64_t lo = INT64_MAX, hi = -1;
    for (auto [index, v] : stop_versions_) lo = std::min(lo, v), hi = std::max(hi, v);
    // The same clock in two rounds 0.2 s apart: no push arrived in between (one that was still
    // on its way would have moved a server on, and the round after checkpoints that clock).
    const bool settled = lo == hi && stop_agreed_ == lo;
    stop_agreed_ = lo == hi ? lo : -1;
    if (settled || since(stop_started_) > 30) {
      const int64_t clock = newest_common_clock(lists_);
      const std::string reason = fmt::format(
          "stopped by signal {} at clock {}: every server holds its checkpoint of that clock; "
          "continue with `moetrain ps launch --resume` (or `ps scheduler --resume`)",
          stop_signal_, clock);
      if (lo != hi)
        log_warn("ps scheduler: the servers stand at clocks {}..{}; the newest they all "
                 "checkpointed is {}",
                 lo, hi, clock);
      events_.job("job_stopped", reason, {{"clock", clock}, {"signal", stop_signal_}});
      shutdown_all(reason);
      return true;
    }
    stop_versions_.clear();
  }
  if (stop_versions_.empty() && since(stop_asked_) > 0.2) {
    stop_asked_ = Clock::now();
    lists_.clear();
    for (Node* p : members_.serving())
      if (p->primary)
        send_to(router_, p->identity, json_frame(Kind::CheckpointQuery, -1, {{"write", true}}));
  }
  if (since(stop_started_) > 60) {
    shutdown_all(fmt::format("stopped by signal {}: the servers did not checkpoint within 60 s",
                             stop_signal_));
    return true;
  }
  return false;
}

void Scheduler::on_stop_checkpoint(const Node& n, const nlohmann::json& j) {
  if (!n.primary || n.index < 0) return;
  lists_[n.index] = j.at("clocks").get<std::vector<int64_t>>();
  stop_versions_[n.index] = j.at("version").get<int64_t>();
}

}  // namespace moetrain::ps
