// The scheduler's handling of server failures (see scheduler.h): a dead primary's backup is
// promoted, a spare or a newly registered server becomes the new backup of a shard that has none,
// and a shard without a replica waits for a replacement, then every server rolls back. Also the
// primaries' rounds of a sync update's global figures (ps/global_norm.h).
#include "core/log.h"
#include "ps/job_plan.h"
#include "ps/scheduler_state.h"

namespace moetrain::ps {

// A server went silent. Returns false when the job has to stop.
bool Scheduler::on_server_lost(Node& n) {
  const double hb_timeout = args_.options.heartbeat_timeout;
  events_.node(n.primary ? "server_lost" : "backup_lost", n,
               fmt::format("no heartbeat for {:.1f} s", hb_timeout));
  if (n.index < 0) {
    log_warn("ps scheduler: spare server (node {}, pid {}) is gone", n.id, n.pid);
    return true;
  }
  if (!started_) {
    shutdown_all(fmt::format("server {} (node {}, pid {}) died before the job started", n.index,
                             n.id, n.pid));
    return false;
  }
  if (!n.primary) {
    log_warn(
        "ps scheduler: the backup of server {} (node {}, pid {}) sent no heartbeat for "
        "{:.1f} s; its primary goes on without a replica",
        n.index, n.id, n.pid, hb_timeout);
    ++servers_lost_;
    if (!attach_spare()) broadcast_setup();
    return true;
  }
  ++servers_lost_;
  if (Node* b = members_.backup_of(n.index)) {
    b->primary = true;
    ++failovers_;
    events_.node("failover", *b, fmt::format("server {} lost; its backup is promoted", n.index));
    log_warn(
        "ps scheduler: server {} (node {}, pid {}) sent no heartbeat for {:.1f} s: its "
        "backup (node {}, pid {}) is promoted; workers re-route to {}",
        n.index, n.id, n.pid, hb_timeout, b->id, b->pid, b->endpoint);
    ++epoch_;
    broadcast_setup();
    attach_spare();
    return true;
  }
  if (args_.options.checkpoint_every == 0 || restoring_) {
    shutdown_all(fmt::format(
        "server {} (node {}, pid {}) sent no heartbeat for {:.1f} s and has no replica{}: the "
        "job stops",
        n.index, n.id, n.pid, hb_timeout,
        restoring_ ? " (during a roll-back)" : " and no checkpoints (--checkpoint-every 0)"));
    return false;
  }
  down_[n.index] = Clock::now();
  finishing_ = false;
  for (Node* s : members_.alive_servers())
    if (s->index < 0) {
      s->index = n.index;
      log_warn(
          "ps scheduler: server {} (node {}, pid {}) sent no heartbeat for {:.1f} s: the "
          "spare (node {}, pid {}) replaces it",
          n.index, n.id, n.pid, hb_timeout, s->id, s->pid);
      begin_restore(n.index);
      return true;
    }
  log_warn(
      "ps scheduler: server {} (node {}, pid {}) sent no heartbeat for {:.1f} s and has no "
      "replica: waiting up to {} s for a replacement (`moetrain ps server --scheduler {}`), "
      "which restores from its checkpoint",
      n.index, n.id, n.pid, hb_timeout, args_.options.server_wait, endpoint_);
  ++epoch_;
  broadcast_setup();
  return true;
}

// Roll-back, step 1: a replacement server registered; every primary says which checkpointed
// clocks it holds.
void Scheduler::begin_restore(int64_t index) {
  restoring_ = true;
  restore_index_ = index;
  lists_.clear();
  ++epoch_;
  broadcast_setup();  // the replacement learns its range; workers still see the index down
  for (int64_t i = 0; i < args_.options.servers; ++i)
    if (Node* p = members_.primary_of(i))
      send_to(router_, p->identity, json_frame(Kind::CheckpointQuery, -1, {}));
}

// Step 2: the newest clock every server holds (clock 0, the initialisation, always exists).
void Scheduler::on_checkpoint_list(const Node& n, const nlohmann::json& j) {
  if (!n.primary) return;
  lists_[n.index] = j.at("clocks").get<std::vector<int64_t>>();
  if (static_cast<int64_t>(lists_.size()) < args_.options.servers) return;
  const int64_t clock = newest_common_clock(lists_);
  ++generation_;
  norm_rounds_.drop_before(generation_);
  std::erase_if(norm_waiting_,
                [&](const auto& kv) { return std::get<0>(kv.first) < generation_; });
  rollback_clock_ = clock;
  restored_ = 0;
  log_warn("ps scheduler: every server rolls back to clock {} (generation {})", clock, generation_);
  for (Node* s : members_.serving())
    send_to(router_, s->identity,
            json_frame(Kind::Restore, -1, {{"clock", clock}, {"generation", generation_}}));
}

// Step 3: once every server restored, workers drop what they were doing and pull.
void Scheduler::on_restored() {
  if (++restored_ < static_cast<int64_t>(members_.serving().size())) return;
  restoring_ = false;
  down_.clear();
  for (auto& [id, w] : members_.nodes()) w.done = false;
  finishing_ = false;
  if (restore_index_ < 0) {
    log_info("ps scheduler: every server restored; the job resumes at clock {}", rollback_clock_);
    events_.job("resumed", "", {{"clock", rollback_clock_}});
  } else {
    ++rollbacks_;
    log_warn("ps scheduler: server {} restored; the job continues from clock {}", restore_index_,
             rollback_clock_);
    events_.job("rollback", fmt::format("server {} replaced", restore_index_),
                {{"index", restore_index_}, {"clock", rollback_clock_}});
  }
  ++epoch_;
  broadcast_setup();
  capacity_rewound(rollback_clock_,
                   restore_index_ < 0 ? "the job resumed" : "the servers rolled back");
}

// With replicas, the first shard whose primary serves without a backup (after a promotion, or
// after its backup died); −1 when every shard has one.
int64_t Scheduler::shard_without_backup() {
  if (args_.options.server_replicas != 2 || restoring_) return -1;
  for (int64_t i = 0; i < args_.options.servers; ++i)
    if (members_.primary_of(i) && !members_.backup_of(i) && !down_.count(i)) return i;
  return -1;
}

// A waiting spare becomes the backup of a shard that has none. Returns whether one did (and the
// new layout went out).
bool Scheduler::attach_spare() {
  const int64_t idx = shard_without_backup();
  if (idx < 0) return false;
  for (Node* s : members_.alive_servers())
    if (s->index < 0) {
      s->index = idx;
      s->primary = false;
      backup_attached(*s, "a spare takes the place of the lost replica");
      return true;
    }
  return false;
}

// The primary of the shard streams its state, then every update, to its new backup (the layout
// names it); from then on a second failure of the shard is survived.
void Scheduler::backup_attached(const Node& b, const std::string& cause) {
  log_warn("ps scheduler: server node {} (pid {}) is the new backup of server {} ({})", b.id, b.pid,
           b.index, cause);
  events_.node("backup_joined", b, cause);
  ++backups_attached_;
  ++epoch_;
  broadcast_setup();
}

// One primary's part of a round of a sync update (ps/global_norm.h); once every server's is in,
// the sum goes to each server that reported (a server that reports a decided round again, e.g. a
// promoted backup, is answered at once), with the clip decision for a clip round.
void Scheduler::on_norm_report(const Node& n, const Incoming& in) {
  const nlohmann::json j = in.json();
  const auto generation = j.at("generation").get<uint32_t>();
  const auto version = j.at("version").get<int64_t>();
  const RoundKind kind = parse_round_kind(j.at("kind").get<std::string>());
  if (generation < generation_) return;  // a clock a roll-back undid
  const auto key = std::make_tuple(generation, version, static_cast<int>(kind));
  auto& waiting = norm_waiting_[key];
  waiting.push_back(n.identity);
  const std::optional<std::vector<double>> sum = norm_rounds_.report(
      generation, version, kind, n.index, j.at("part").get<std::vector<double>>());
  if (!sum) return;
  nlohmann::json body = {{"version", version},
                         {"generation", generation},
                         {"kind", round_kind_name(kind)},
                         {"sum", *sum}};
  if (kind == RoundKind::Clip) {
    MOETRAIN_CHECK(sum->size() == 1, "a clip round of {} figures", sum->size());
    const ClipDecision d = decide_clip(sum->front(), args_.config.optim.grad_clip);
    body["norm"] = d.norm;
    body["scale"] = d.scale;
  }
  const std::string reply = json_frame(Kind::ClipScale, -1, body);
  for (const std::string& id : waiting) send_to(router_, id, reply);
  norm_waiting_.erase(key);
}

// A round that some server never reported to stops the job, naming them: a dead server is found
// by its heartbeats first (and replaced, or its backup promoted, which reports again), so this
// catches a server that lives but does not answer. Returns false when the job stopped.
bool Scheduler::check_norm_rounds() {
  const double limit = args_.options.server_wait + 2 * args_.options.heartbeat_timeout;
  const auto late = norm_rounds_.overdue(limit);
  if (!late) return true;
  shutdown_all(fmt::format(
      "update {}: server(s) {} sent no part of the update's global figures within {:.0f} s "
      "(--server-wait + twice --heartbeat-timeout) of the first server's, so optim.grad_clip's "
      "global norm (or grad.expert_reweight's factors, or grad.sparse_experts' mask) cannot be "
      "taken",
      late->first, fmt::join(late->second, ", "), limit));
  return false;
}

}  // namespace moetrain::ps
