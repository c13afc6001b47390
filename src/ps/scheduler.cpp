#include "ps/scheduler.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>
#include <thread>

#include "core/check.h"
#include "core/log.h"
#include "io/file.h"
#include "model/params.h"
#include "ps/job_plan.h"
#include "ps/job_dir.h"
#include "ps/scheduler_state.h"
#include "train/stop_signal.h"

namespace fs = std::filesystem;

namespace moetrain::ps {

Scheduler::Scheduler(const SchedulerArgs& a, std::unique_ptr<SchedulerSocket> socket)
    : args_(a),
      socket_(socket ? std::move(socket) : std::make_unique<SchedulerSocket>(a.bind)),
      router_(socket_->router) {
  args_.options.validate();
  check_ps_run_config(args_.config, args_.options);
  total_keys_ = job_keys(args_.config);
  norm_rounds_ = NormRounds(args_.options.servers);
  global_rows_ = args_.options.workers * args_.config.train.batch_size;
  if (args_.config.model.capacity == CapacityMode::Dynamic) {
    const auto& m = args_.config.model;
    capacity_ = CapacityRounds(m.balance, m.capacity_factor, m.n_moe_layers(), m.n_experts);
  } else if (args_.config.placement.enabled() &&
             args_.options.consistency_kind() == Consistency::Sync) {
    // Worker groups place their replicas from the job's loads, which the round hands out.
    capacity_ = CapacityRounds::loads_only(args_.config.model.n_moe_layers(),
                                           args_.config.model.n_experts);
  }
  // Before anything in the run directory is written: another run writing it, or an earlier run
  // it holds without --resume, stops the job here. A standby joins the job its scheduler holds.
  if (!args_.standby) lock_ = open_job_dir(args_.config.train.run_dir, args_.resume);
  endpoint_ = socket_->endpoint;
  fs::create_directories(fs::path(args_.config.train.run_dir) / "ps");
  if (!args_.endpoint_file.empty()) write_file_atomic(args_.endpoint_file, endpoint_ + "\n");
  // A resumed job's controllers restart from the record of the run it continues.
  if (args_.resume && capacity_.active()) capacity_.load_record(capacity_record());
  events_ = JobEvents(args_.config.train.run_dir, !args_.standby && !args_.resume);
  if (args_.elected.is_object()) record_election();
  log_info("ps scheduler at {}: waiting for {} server(s) and {} worker(s)", endpoint_,
           args_.options.servers, args_.options.workers);
}

int Scheduler::run() {
  const auto hb_timeout = args_.options.heartbeat_timeout;
  const StopSignals signals;
  for (;;) {
    zmq::pollitem_t item{router_.handle(), 0, ZMQ_POLLIN, 0};
    poll_sockets(&item, 1, 50);
    while (auto in = try_receive(router_, true, rejects_, "ps scheduler")) handle(*in);
    if (finished_) return exit_code_;
    if (stop_signal() != 0 && stop_ == Stop::None) {
      if (!started_ || finishing_) {
        shutdown_all(fmt::format("stopped by signal {} {}", stop_signal(),
                                 started_ ? "while the job was finishing" : "before the job started"));
        return 128 + stop_signal();
      }
      begin_stop(stop_signal());
    }
    if (stop_ != Stop::None) {
      if (advance_stop()) return 128 + stop_signal_;
      continue;
    }
    // Liveness.
    for (auto& [id, n] : members_.nodes()) {
      if (!n.alive || since(n.last_seen) <= hb_timeout) continue;
      n.alive = false;
      if (n.role == "server") {
        if (!on_server_lost(n)) return 1;
        continue;
      }
      log_warn(
          "ps scheduler: worker {} (node {}, pid {}) sent no heartbeat for {:.1f} s: "
          "declared dead, its rows go to the others",
          n.index, id, n.pid, hb_timeout);
      events_.node("worker_lost", n, fmt::format("no heartbeat for {:.1f} s", hb_timeout));
      ++workers_lost_;
      if (finishing_ && id == lead_) finishing_ = false;  // another worker will lead
      if (started_) replan(fmt::format("worker {} lost", n.index));
    }
    for (auto& [index, t] : down_)
      if (since(t) > args_.options.server_wait) {
        shutdown_all(fmt::format(
            "server {} died and no replacement registered within --server-wait {} s (start one "
            "with `moetrain ps server --scheduler {}`; it restores from {}/ps/server_{})",
            index, args_.options.server_wait, endpoint_, args_.config.train.run_dir, index));
        return 1;
      }
    if (started_ && !finishing_ && down_.empty()) {
      if (members_.alive_workers().empty()) {
        if (since(last_worker_seen_) > hb_timeout) {
          shutdown_all("every worker is gone and none rejoined within the heartbeat timeout");
          return 1;
        }
      } else {
        last_worker_seen_ = Clock::now();
      }
      maybe_rebalance();
      maybe_finish();
    }
    if (taking_over_ && !maybe_take_over()) return 1;
    // A worker that died leaves the clock's round to the others.
    if (started_ && !finishing_) decide_capacity();
    if (!capacity_error_.empty() || !start_error_.empty()) {
      shutdown_all(start_error_.empty() ? capacity_error_ : start_error_);
      return 1;
    }
    if (!check_norm_rounds()) return 1;
    if (finishing_ && since(finish_started_) > 10 * hb_timeout + 60) {
      shutdown_all("the final checkpoint and summaries were not written in time");
      return 1;
    }
  }
}

void Scheduler::handle(const Incoming& in) {
  const Header& h = in.header;
  Node* node = members_.find(h.sender);
  if (node) {
    if (!node->alive) {
      // Declared dead (e.g. stopped, then continued): it must not rejoin under its old id.
      send_to(router_, in.identity,
              json_frame(Kind::Shutdown, -1,
                         {{"ok", false},
                          {"reason",
                           "this node was declared dead after missing heartbeats; "
                           "restart it to rejoin"}}));
      return;
    }
    node->last_seen = Clock::now();
  }
  try {
    switch (h.kind_enum()) {
      case Kind::Register:
        on_register(in);
        break;
      case Kind::Heartbeat:
        if (!node) return;
        if (node->role == "worker" && h.value > 0) node->throughput = h.value;
        send_to(router_, in.identity,
                json_frame(Kind::HeartbeatAck, -1, heartbeat_ack(*node)));
        break;
      case Kind::Done:
        // A Done of a generation that a roll-back undid does not count.
        if (node && node->role == "worker" &&
            in.json().value("generation", int64_t{0}) == static_cast<int64_t>(generation_))
          node->done = true;
        break;
      case Kind::CheckpointList:
        if (node && node->role == "server" && stop_ == Stop::Checkpointing)
          on_stop_checkpoint(*node, in.json());
        else if (node && node->role == "server" && restoring_)
          on_checkpoint_list(*node, in.json());
        break;
      case Kind::Restored:
        if (node && node->role == "server" && restoring_) on_restored();
        break;
      case Kind::FinishAck:
        if (node) on_finish_ack(*node);
        break;
      case Kind::RowsReady:
        if (node && node->role == "worker") on_rows_ready(*node, in.json());
        break;
      case Kind::CapacityReport:
        if (node && node->role == "worker" && node->index >= 0)
          on_capacity_report(*node, in.json());
        break;
      case Kind::NormReport:
        if (node && node->role == "server" && node->primary && node->index >= 0)
          on_norm_report(*node, in);
        break;
      default:
        log_warn("ps scheduler: ignored a {} message from node {}", kind_name(h.kind_enum()),
                 h.sender);
    }
  } catch (const Error& e) {
    ++rejects_.rejected;
    log_warn("ps scheduler: rejected a {} message from node {}: {}", kind_name(h.kind_enum()),
             h.sender, e.what());
  }
}

void Scheduler::on_register(const Incoming& in) {
  nlohmann::json j = in.json();
  const std::string role = j.value("role", "");
  MOETRAIN_CHECK(role == "server" || role == "worker",
                 "register: role '{}' (expected server or worker)", role);
  if (j.value("rejoin", false)) {
    on_rejoin(in, j);
    return;
  }
  Node n;
  n.id = next_id_++;
  n.role = role;
  n.identity = in.identity;
  n.last_seen = Clock::now();
  n.pid = j.value("pid", int64_t{0});
  auto reply = [&](const nlohmann::json& body) {
    send_to(router_, in.identity, json_frame(Kind::HeartbeatAck, -1, body));
  };
  if (role == "server") {
    n.endpoint = j.value("endpoint", "");
    n.successor = j.value("successor", "");
    MOETRAIN_CHECK(n.endpoint.starts_with("tcp://"), "register: server endpoint '{}'", n.endpoint);
    const int64_t S = args_.options.servers;
    int64_t idx = -1;
    if (!started_) {
      for (int64_t i = 0; i < S && idx < 0; ++i)
        if (!members_.primary_of(i)) idx = i;
      for (int64_t i = 0; i < S && idx < 0 && args_.options.server_replicas == 2; ++i)
        if (!members_.backup_of(i)) idx = i, n.primary = false;
    } else if (!down_.empty() && !restoring_) {
      idx = down_.begin()->first;  // a replacement for a dead server without a replica
    } else if (args_.options.server_replicas == 2 && !restoring_) {
      idx = shard_without_backup();  // the new backup of a promoted primary
      if (idx >= 0) n.primary = false;
    }
    // An extra server waits as a spare: without replicas it replaces the next one that dies (a
    // restarted server may register before the dead one's heartbeats ran out), with replicas it
    // becomes the new backup of the next shard that loses one. Spares may come before the start
    // too (`ps launch --spare-servers` starts them with the others).
    const bool spare =
        idx < 0 && (args_.options.server_replicas == 2 || args_.options.checkpoint_every > 0);
    if (idx < 0 && !spare) {
      send_to(router_, in.identity,
              json_frame(
                  Kind::Shutdown, -1,
                  {{"ok", false},
                   {"reason",
                    fmt::format("the job already has its {} server(s){}", S,
                                args_.options.server_replicas == 2 ? " and their backups" : "")}}));
      return;
    }
    n.index = idx;
  } else {
    n.index = members_.free_worker_index(j.value("want_index", int64_t{-1}));
    n.group_size = j.value("group_size", int64_t{1});
    MOETRAIN_CHECK(n.group_size >= 1, "register: group_size {} (expected ≥ 1)", n.group_size);
  }
  members_.nodes()[n.id] = n;
  reply({{"node_id", n.id},
         {"index", n.index},
         {"heartbeat_interval", args_.options.heartbeat_interval},
         {"heartbeat_timeout", args_.options.heartbeat_timeout}});
  log_info("ps scheduler: {} {}{} registered (node {}, pid {})", role, n.index,
           role == "server" && !n.primary    ? " (backup)"
           : role == "server" && n.index < 0 ? " (spare)"
                                             : "",
           n.id, n.pid);
  if (!started_) {
    if (static_cast<int64_t>(members_.serving().size()) ==
            args_.options.servers * args_.options.server_replicas &&
        static_cast<int64_t>(members_.alive_workers().size()) >= args_.options.workers) {
      started_ = true;
      last_worker_seen_ = Clock::now();
      // The quorum counts groups, which the workers' registrations tell (a group of P registers
      // P workers of group size P).
      if (args_.options.consistency_kind() == Consistency::Quorum) {
        double groups = 0;
        for (const Node* w : members_.alive_workers())
          groups += 1.0 / static_cast<double>(w->group_size);
        const auto g = static_cast<int64_t>(std::llround(groups));
        if (args_.options.quorum > g)
          start_error_ = fmt::format(
              "--quorum {}: the quorum counts worker groups (a group's parts of a clock are "
              "applied together), and the {} workers that started form {} group{}; allowed are "
              "1..{}",
              args_.options.quorum, members_.alive_workers().size(), g, g == 1 ? "" : "s", g);
      }
      // Every worker of the start computes the first clock (a resumed job's: capacity_rewound).
      for (Node* w : members_.alive_workers()) capacity_from_[w->id] = 0;
      events_.job(args_.resume ? "job_resume" : "job_start");
      log_info("ps scheduler: job {} ({} keys over {} server(s), {} rows per step)",
               args_.resume ? "resumes" : "starts", total_keys_, args_.options.servers,
               global_rows_);
      if (args_.resume) {
        // Every server restores the newest clock all of them checkpointed (begin_restore's
        // roll-back over the whole job); until then the workers see no server to pull from.
        restoring_ = true;
        restore_index_ = -1;
        lists_.clear();
      }
      replan("job start");
      if (args_.resume)
        for (Node* p : members_.serving())
          if (p->primary) send_to(router_, p->identity, json_frame(Kind::CheckpointQuery, -1, {}));
    }
  } else if (role == "worker") {
    events_.node("worker_joined", n, "registered after the start");
    ++workers_joined_;
    replan(fmt::format("worker {} joined", n.index));
  } else if (n.index >= 0 && !n.primary) {
    backup_attached(members_.nodes()[n.id], "registered after the start");
  } else if (n.index >= 0) {
    begin_restore(n.index);
  }
}

namespace {

std::vector<WorkerRate> worker_rates(const std::vector<Node*>& workers) {
  std::vector<WorkerRate> r;
  for (const Node* w : workers) r.push_back({w->index, w->group_size, w->throughput});
  return r;
}

}  // namespace

// New row assignment and membership, sent to every live node.
void Scheduler::replan(const std::string& cause) {
  // A membership change moves rows at once (the clock in flight completes with the pushes it
  // gets); a rebalance that was being agreed on is dropped.
  rows_query_.reset();
  rows_from_ = -1;
  rows_settled_ = 2 * epoch_ + 1;  // every query of this epoch
  auto workers = members_.alive_workers();
  if (!workers.empty()) {
    const bool capability = args_.options.assign_kind() == Assign::Capability;
    // Under capability, uniform until every worker reported a rate.
    std::optional<RowSplit> split;
    if (capability) split = split_rows_by_group(global_rows_, worker_rates(workers), true);
    if (!split) split = split_rows_by_group(global_rows_, worker_rates(workers), false);
    rows_ = split->rows;
    if (capability) events_.record(assign_record(*split, -1, cause));
  }
  ++epoch_;
  broadcast_setup();
}

void Scheduler::maybe_rebalance() {
  if (args_.options.assign_kind() != Assign::Capability || rows_query_ ||
      since(last_rebalance_) < args_.options.rebalance_every)
    return;
  last_rebalance_ = Clock::now();
  auto workers = members_.alive_workers();
  if (workers.empty()) return;
  auto split = split_rows_by_group(global_rows_, worker_rates(workers), true);
  if (!split || split->rows == rows_) return;
  // Every worker stops before its next clock and says which it is (on_rows_ready); a group's
  // ranks answer together from the same point between two clocks.
  rows_query_ = RowsQuery{2 * epoch_, std::move(*split), {}};
  for (Node* w : workers)
    send_to(router_, w->identity, json_frame(Kind::RowsQuery, -1, {{"query", rows_query_->id}}));
}

// The new split applies from the largest clock any worker would start next: every clock before
// it is computed with the old split by every worker, every later one with the new.
void Scheduler::on_rows_ready(const Node& n, const nlohmann::json& j) {
  if (stop_ == Stop::Pausing) {
    paused_.insert(n.id);
    return;
  }
  if (!rows_query_ || j.value("query", int64_t{-1}) != rows_query_->id) return;
  rows_query_->next_clock[n.id] = j.at("clock").get<int64_t>();
  int64_t from = 0;
  for (Node* w : members_.alive_workers()) {
    auto it = rows_query_->next_clock.find(w->id);
    if (it == rows_query_->next_clock.end()) return;
    from = std::max(from, it->second);
  }
  rows_ = rows_query_->split.rows;
  rows_settled_ = rows_query_->id;
  rows_from_ = from;
  // Recorded before any worker hears of it, as every decision of the scheduler is.
  events_.record(assign_record(rows_query_->split, from, "measured throughput"));
  rows_query_.reset();
  log_info("ps scheduler: capability assignment from clock {}: rows per worker {}", from,
           fmt::join(rows_, ", "));
  ++epoch_;
  broadcast_setup();
}

void Scheduler::broadcast_setup() {
  auto keys = split_keys(total_keys_, args_.options.servers);
  std::vector<ServerSlot> slots;
  nlohmann::json ranges = nlohmann::json::array();
  for (int64_t s = 0; s < args_.options.servers; ++s) {
    Node* p = members_.primary_of(s);
    Node* b = members_.backup_of(s);
    // A server that is down, or restoring, is listed without an endpoint: workers wait.
    const bool up =
        p && !down_.count(s) && !(restoring_ && (restore_index_ < 0 || s == restore_index_));
    slots.push_back({up ? p->endpoint : "", b ? b->endpoint : ""});
    ranges.push_back({keys[s].begin, keys[s].end});
  }
  std::vector<int64_t> indices;
  for (Node* w : members_.alive_workers()) indices.push_back(w->index);
  const nlohmann::json js = setup_servers(slots, keys), jw = setup_workers(indices, rows_);
  nlohmann::json base = {{"epoch", epoch_},
                         {"generation", generation_},
                         {"rollback_to", rollback_clock_},
                         {"resume", args_.resume},
                         {"rows_from_clock", rows_from_},
                         {"rows_settled", rows_settled_},
                         {"config", args_.config.to_json()},
                         {"options", args_.options.to_json()},
                         {"servers", js},
                         {"ranges", ranges},
                         {"workers", jw},
                         {"global_rows", global_rows_},
                         {"total_keys", total_keys_}};
  for (auto& [id, n] : members_.nodes()) {
    if (!n.alive || (n.role == "server" && n.index < 0)) continue;
    nlohmann::json j = base;
    j["node_id"] = n.id;
    j["role"] = n.role;
    j["index"] = n.index;
    if (n.role == "server") j["replica"] = n.primary ? "primary" : "backup";
    send_to(router_, n.identity, json_frame(Kind::Setup, -1, j));
  }
  nlohmann::json job = {{"scheduler", endpoint_},
                        {"epoch", epoch_},
                        {"generation", generation_},
                        {"servers", js},
                        {"workers", jw}};
  nlohmann::json pids = nlohmann::json::array();
  for (auto& [id, n] : members_.nodes())
    if (n.alive)
      pids.push_back(
          {{"role", n.role}, {"index", n.index}, {"pid", n.pid}, {"primary", n.primary}});
  job["nodes"] = pids;
  write_file_atomic(fs::path(args_.config.train.run_dir) / "ps" / "job.json", job.dump(2) + "\n");
}

void Scheduler::maybe_finish() {
  auto workers = members_.alive_workers();
  if (workers.empty()) return;
  for (Node* w : workers)
    if (!w->done) return;
  finishing_ = true;
  finish_started_ = Clock::now();
  lead_ = workers.front()->id;
  send_to(router_, workers.front()->identity, json_frame(Kind::Finish, -1, {{"lead", true}}));
  log_info("ps scheduler: every worker is done; worker {} writes the final checkpoint",
           workers.front()->index);
}

void Scheduler::on_finish_ack(Node& n) {
  if (n.role == "worker" && n.id == lead_) {
    for (Node* s : members_.serving())
      send_to(router_, s->identity, json_frame(Kind::Finish, -1, {}));
    servers_acked_ = 0;
  } else if (n.role == "server") {
    if (++servers_acked_ == static_cast<int64_t>(members_.serving().size())) {
      nlohmann::json summary = {
          {"workers_lost", workers_lost_},          {"workers_joined", workers_joined_},
          {"servers_lost", servers_lost_},          {"failovers", failovers_},
          {"backups_attached", backups_attached_},  {"rollbacks", rollbacks_},
          {"rejected_messages", rejects_.rejected}, {"epochs", epoch_}};
      write_file_atomic(fs::path(args_.config.train.run_dir) / "ps" / "scheduler.json",
                        summary.dump(2) + "\n");
      for (auto& [id, node] : members_.nodes())
        if (node.alive)
          send_to(router_, node.identity,
                  json_frame(Kind::Shutdown, -1, {{"ok", true}, {"reason", "job complete"}}));
      log_info("ps scheduler: job complete");
      events_.job("job_complete");
      finished_ = true;
      exit_code_ = 0;
    }
  }
}

void Scheduler::shutdown_all(const std::string& reason) {
  log_error("ps scheduler: {}", reason);
  events_.job("job_stopped", reason);
  for (auto& [id, n] : members_.nodes())
    if (n.alive)
      send_to(router_, n.identity,
              json_frame(Kind::Shutdown, -1, {{"ok", false}, {"reason", reason}}));
  // Let the sends leave before the context closes.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
}

int run_scheduler(const SchedulerArgs& args) {
  Scheduler s(args);
  return s.run();
}

}  // namespace moetrain::ps
