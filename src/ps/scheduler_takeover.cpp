// A standby scheduler taking over a job whose scheduler died (see scheduler.h). The scheduler
// holds only metadata, and all of it lives on in the nodes: servers know their index, replica
// role and endpoint, workers their index, rows and whether they are done, both the roll-back
// generation. Each node that finds the scheduler silent registers with the standby as the node it
// was; once every expected node came (or twice the heartbeat timeout passed and every server
// index has its primary), the standby rebuilds membership and assignment from them and sends the
// next layout. Training does not stop meanwhile: workers and servers talk to each other directly.
// Without a standby the same takeover runs in the server the others elected (ps/election.h).
#include <algorithm>

#include "core/check.h"
#include "core/log.h"
#include "ps/election.h"
#include "ps/scheduler_state.h"

namespace moetrain::ps {

void Scheduler::on_rejoin(const Incoming& in, const nlohmann::json& j) {
  Node n;
  n.id = j.at("node_id").get<int32_t>();
  n.role = j.at("role").get<std::string>();
  MOETRAIN_CHECK(n.id >= 0 && !members_.find(n.id), "rejoin of node {}: no id, or taken", n.id);
  n.identity = in.identity;
  n.last_seen = Clock::now();
  n.pid = j.value("pid", int64_t{0});
  n.index = j.at("index").get<int64_t>();
  if (n.role == "server") {
    n.endpoint = j.at("endpoint").get<std::string>();
    n.primary = j.at("primary").get<bool>();
    n.successor = j.value("successor", "");
    // A spare holds no state, so its generation (that of the last setup it saw) says nothing.
    if (n.index >= 0) rejoin_generations_.insert(j.value("generation", uint32_t{0}));
  } else {
    n.done = j.value("done", false);
    rejoin_rows_[n.index] = j.at("rows").get<int64_t>();
    n.group_size = j.value("group_size", int64_t{1});
  }
  generation_ = std::max(generation_, j.value("generation", uint32_t{0}));
  epoch_ = std::max(epoch_, j.value("epoch", int64_t{0}));
  next_id_ = std::max(next_id_, n.id + 1);
  members_.nodes()[n.id] = n;
  send_to(router_, in.identity,
          json_frame(Kind::HeartbeatAck, -1,
                     {{"node_id", n.id},
                      {"index", n.index},
                      {"heartbeat_interval", args_.options.heartbeat_interval},
                      {"heartbeat_timeout", args_.options.heartbeat_timeout}}));
  log_warn("ps scheduler: {} {} (node {}, pid {}) registered again: its scheduler is gone", n.role,
           n.index, n.id, n.pid);
  if (!taking_over_ && !started_) {
    taking_over_ = true;
    takeover_started_ = Clock::now();
    // A standby opened metrics/scheduler.jsonl when it started, which may have been before the
    // job's scheduler replaced an earlier job's file: append to the file that is there now.
    events_ = JobEvents(args_.config.train.run_dir, false);
    // The dead scheduler's record, up to its last decision.
    if (capacity_.active()) {
      try {
        capacity_takeover_clock_ = capacity_.load_record(capacity_record());
      } catch (const Error& e) {
        capacity_error_ = fmt::format("a successor took over the job: {}", e.what());
      }
    }
  }
}

// Returns false when the job cannot go on.
bool Scheduler::maybe_take_over() {
  const int64_t S = args_.options.servers;
  const bool everyone =
      static_cast<int64_t>(members_.serving().size()) == S * args_.options.server_replicas &&
      static_cast<int64_t>(members_.alive_workers().size()) >= args_.options.workers;
  if (!everyone && since(takeover_started_) <= 2 * args_.options.heartbeat_timeout) return true;
  // A primary that died with the scheduler (an election passes it over; a standby waits for
  // it): its backup is promoted, as the scheduler would have done.
  bool promoted = false;
  for (int64_t i = 0; i < S; ++i) {
    Node* b = members_.backup_of(i);
    if (members_.primary_of(i) || !b) continue;
    b->primary = true;
    promoted = true;
    ++servers_lost_;
    ++failovers_;
    events_.node("failover", *b,
                 fmt::format("server {}'s primary did not register again after the scheduler "
                             "died; its backup is promoted",
                             i));
    log_warn("ps scheduler: server {}'s primary did not register again: its backup (node {}, pid "
             "{}) is promoted",
             i, b->id, b->pid);
  }
  for (int64_t i = 0; i < S; ++i)
    if (!members_.primary_of(i)) {
      shutdown_all(fmt::format(
          "the scheduler died and server {} did not register with the standby within {:.1f} s", i,
          2 * args_.options.heartbeat_timeout));
      return false;
    }
  // Servers of different generations: the scheduler died within a roll-back, which only it knew
  // the state of (which servers restored); going on would mix clocks.
  if (rejoin_generations_.size() > 1) {
    shutdown_all(
        "the scheduler died during a roll-back (the servers are at different generations); the "
        "job stops");
    return false;
  }
  taking_over_ = false;
  started_ = true;
  last_worker_seen_ = Clock::now();
  rows_.clear();
  int64_t sum = 0;
  for (Node* w : members_.alive_workers()) {
    rows_.push_back(rejoin_rows_[w->index]);
    sum += rows_.back();
  }
  const std::string who =
      args_.elected.is_object()
          ? fmt::format("server {} (elected)", args_.elected.value("server", int64_t{-1}))
          : std::string("the standby");
  log_warn("ps scheduler: {} takes over the job ({} server(s), {} worker(s))", who,
           members_.serving().size(), members_.alive_workers().size());
  events_.job("scheduler_takeover", "the scheduler stopped answering",
              {{"by", args_.elected.is_object() ? "elected server" : "standby"},
               {"servers", members_.serving().size()},
               {"workers", members_.alive_workers().size()}});
  // A rebalance the dead scheduler was agreeing on is dropped: its paused workers go on.
  rows_settled_ = 2 * epoch_ + 1;
  // A worker that did not come back leaves rows that nobody reads: re-plan then.
  if (sum == global_rows_) {
    ++epoch_;
    broadcast_setup();
  } else {
    replan("a worker did not come back to the new scheduler");
  }
  capacity_rewound(capacity_takeover_clock_, "a successor took over the job");
  if (promoted) attach_spare();
  return true;
}

// An elected server's scheduler: what the election decided and why, its first event.
void Scheduler::record_election() {
  nlohmann::json extra = args_.elected;
  const std::string cause = extra.value("cause", "");
  extra.erase("cause");
  events_.job("scheduler_elected", cause, extra);
  log_warn("ps scheduler: elected at {}: {}", endpoint_, cause);
}

// The job's own scheduler tells every node the succession order with each heartbeat; a standby
// or an elected scheduler does not (one takeover per job).
nlohmann::json Scheduler::heartbeat_ack(const Node& n) {
  nlohmann::json ack = {{"node_id", n.id}};
  if (!args_.standby) ack["successors"] = succession_order(members_);
  return ack;
}

}  // namespace moetrain::ps
