#include "ps/scheduler.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>

#include "core/check.h"
#include "core/log.h"
#include "io/file.h"
#include "model/params.h"
#include "ps/job_events.h"
#include "ps/job_plan.h"
#include "ps/membership.h"
#include "ps/transport.h"

namespace fs = std::filesystem;

namespace moetrain::ps {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

class Scheduler {
 public:
  explicit Scheduler(const SchedulerArgs& a) : args_(a), router_(ctx_, zmq::socket_type::router) {
    check_ps_run_config(args_.config);
    args_.options.validate();
    total_keys_ = ParamLayout(args_.config.model).size();
    global_rows_ = args_.options.workers * args_.config.train.batch_size;
    endpoint_ = bind_router(ctx_, router_, args_.bind);
    fs::create_directories(fs::path(args_.config.train.run_dir) / "ps");
    if (!args_.endpoint_file.empty()) write_file_atomic(args_.endpoint_file, endpoint_ + "\n");
    events_ = JobEvents(args_.config.train.run_dir);
    log_info("ps scheduler at {}: waiting for {} server(s) and {} worker(s)", endpoint_,
             args_.options.servers, args_.options.workers);
  }

  int run() {
    const auto hb_timeout = args_.options.heartbeat_timeout;
    for (;;) {
      zmq::pollitem_t item{router_.handle(), 0, ZMQ_POLLIN, 0};
      poll_sockets(&item, 1, 50);
      while (auto in = try_receive(router_, true, rejects_, "ps scheduler")) handle(*in);
      if (finished_) return exit_code_;
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
        if (started_) replan();
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
      if (finishing_ && since(finish_started_) > 10 * hb_timeout + 60) {
        shutdown_all("the final checkpoint and summaries were not written in time");
        return 1;
      }
    }
  }

 private:
  void handle(const Incoming& in) {
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
                  json_frame(Kind::HeartbeatAck, -1, {{"node_id", node->id}}));
          break;
        case Kind::Done:
          // A Done of a generation that a roll-back undid does not count.
          if (node && node->role == "worker" &&
              in.json().value("generation", int64_t{0}) == static_cast<int64_t>(generation_))
            node->done = true;
          break;
        case Kind::CheckpointList:
          if (node && node->role == "server" && restoring_) on_checkpoint_list(*node, in.json());
          break;
        case Kind::Restored:
          if (node && node->role == "server" && restoring_) on_restored();
          break;
        case Kind::FinishAck:
          if (node) on_finish_ack(*node);
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

  void on_register(const Incoming& in) {
    nlohmann::json j = in.json();
    const std::string role = j.value("role", "");
    MOETRAIN_CHECK(role == "server" || role == "worker",
                   "register: role '{}' (expected server or worker)", role);
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
      MOETRAIN_CHECK(n.endpoint.starts_with("tcp://"), "register: server endpoint '{}'",
                     n.endpoint);
      const int64_t S = args_.options.servers;
      int64_t idx = -1;
      if (!started_) {
        for (int64_t i = 0; i < S && idx < 0; ++i)
          if (!members_.primary_of(i)) idx = i;
        for (int64_t i = 0; i < S && idx < 0 && args_.options.server_replicas == 2; ++i)
          if (!members_.backup_of(i)) idx = i, n.primary = false;
      } else if (!down_.empty() && !restoring_) {
        idx = down_.begin()->first;  // a replacement for a dead server without a replica
      }
      // Without replicas, an extra server waits as a spare and replaces the next one that dies
      // (a restarted server may register before the dead one's heartbeats ran out).
      const bool spare = idx < 0 && started_ && args_.options.server_replicas == 1 &&
                         args_.options.checkpoint_every > 0;
      if (idx < 0 && !spare) {
        send_to(
            router_, in.identity,
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
      if (static_cast<int64_t>(members_.alive_servers().size()) ==
              args_.options.servers * args_.options.server_replicas &&
          static_cast<int64_t>(members_.alive_workers().size()) >= args_.options.workers) {
        started_ = true;
        last_worker_seen_ = Clock::now();
        events_.job("job_start");
        log_info("ps scheduler: job starts ({} keys over {} server(s), {} rows per step)",
                 total_keys_, args_.options.servers, global_rows_);
        replan();
      }
    } else if (role == "worker") {
      events_.node("worker_joined", n, "registered after the start");
      ++workers_joined_;
      replan();
    } else if (n.index >= 0) {
      begin_restore(n.index);
    }
  }

  // A server went silent. Returns false when the job has to stop.
  bool on_server_lost(Node& n) {
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
      broadcast_setup();
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
  void begin_restore(int64_t index) {
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
  void on_checkpoint_list(const Node& n, const nlohmann::json& j) {
    if (!n.primary) return;
    lists_[n.index] = j.at("clocks").get<std::vector<int64_t>>();
    if (static_cast<int64_t>(lists_.size()) < args_.options.servers) return;
    const int64_t clock = newest_common_clock(lists_);
    ++generation_;
    rollback_clock_ = clock;
    restored_ = 0;
    log_warn("ps scheduler: every server rolls back to clock {} (generation {})", clock,
             generation_);
    for (Node* s : members_.serving())
      send_to(router_, s->identity,
              json_frame(Kind::Restore, -1, {{"clock", clock}, {"generation", generation_}}));
  }

  // Step 3: once every server restored, workers drop what they were doing and pull.
  void on_restored() {
    if (++restored_ < static_cast<int64_t>(members_.serving().size())) return;
    restoring_ = false;
    down_.clear();
    ++rollbacks_;
    for (auto& [id, w] : members_.nodes()) w.done = false;
    finishing_ = false;
    log_warn("ps scheduler: server {} restored; the job continues from clock {}", restore_index_,
             rollback_clock_);
    events_.job("rollback", fmt::format("server {} replaced", restore_index_),
                {{"index", restore_index_}, {"clock", rollback_clock_}});
    ++epoch_;
    broadcast_setup();
  }

  // New row assignment and membership, sent to every live node.
  void replan() {
    auto workers = members_.alive_workers();
    if (!workers.empty()) {
      std::optional<std::vector<double>> weights;
      if (args_.options.assign_kind() == Assign::Capability)
        weights = capability_weights(throughputs(workers));
      rows_ = split_rows(global_rows_, weights.value_or(std::vector<double>(workers.size(), 1.0)));
    }
    ++epoch_;
    broadcast_setup();
  }

  void maybe_rebalance() {
    if (args_.options.assign_kind() != Assign::Capability || since(last_rebalance_) < 2.0) return;
    last_rebalance_ = Clock::now();
    auto workers = members_.alive_workers();
    if (workers.empty()) return;
    const auto weights = capability_weights(throughputs(workers));
    if (!weights) return;
    std::vector<int64_t> rows = split_rows(global_rows_, *weights);
    if (rows == rows_) return;
    log_info("ps scheduler: capability assignment: rows per worker {}", fmt::join(rows, ", "));
    rows_ = rows;
    ++epoch_;
    broadcast_setup();
  }

  void broadcast_setup() {
    auto keys = split_keys(total_keys_, args_.options.servers);
    std::vector<ServerSlot> slots;
    nlohmann::json ranges = nlohmann::json::array();
    for (int64_t s = 0; s < args_.options.servers; ++s) {
      Node* p = members_.primary_of(s);
      Node* b = members_.backup_of(s);
      // A server that is down, or restoring, is listed without an endpoint: workers wait.
      const bool up = p && !down_.count(s) && !(restoring_ && s == restore_index_);
      slots.push_back({up ? p->endpoint : "", b ? b->endpoint : ""});
      ranges.push_back({keys[s].begin, keys[s].end});
    }
    std::vector<int64_t> indices;
    for (Node* w : members_.alive_workers()) indices.push_back(w->index);
    const nlohmann::json js = setup_servers(slots, keys), jw = setup_workers(indices, rows_);
    nlohmann::json base = {{"epoch", epoch_},
                           {"generation", generation_},
                           {"rollback_to", rollback_clock_},
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

  void maybe_finish() {
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

  void on_finish_ack(Node& n) {
    if (n.role == "worker" && n.id == lead_) {
      for (Node* s : members_.serving())
        send_to(router_, s->identity, json_frame(Kind::Finish, -1, {}));
      servers_acked_ = 0;
    } else if (n.role == "server") {
      if (++servers_acked_ == static_cast<int64_t>(members_.serving().size())) {
        nlohmann::json summary = {{"workers_lost", workers_lost_},
                                  {"workers_joined", workers_joined_},
                                  {"servers_lost", servers_lost_},
                                  {"failovers", failovers_},
                                  {"rollbacks", rollbacks_},
                                  {"rejected_messages", rejects_.rejected},
                                  {"epochs", epoch_}};
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

  void shutdown_all(const std::string& reason) {
    log_error("ps scheduler: {}", reason);
    events_.job("job_stopped", reason);
    for (auto& [id, n] : members_.nodes())
      if (n.alive)
        send_to(router_, n.identity,
                json_frame(Kind::Shutdown, -1, {{"ok", false}, {"reason", reason}}));
    // Let the sends leave before the context closes.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }

  SchedulerArgs args_;
  zmq::context_t ctx_;
  zmq::socket_t router_;
  std::string endpoint_;
  RejectStats rejects_;
  Membership members_;
  JobEvents events_;
  int32_t next_id_ = 0;
  int64_t total_keys_ = 0, global_rows_ = 0, epoch_ = 0;
  std::vector<int64_t> rows_;
  bool started_ = false, finishing_ = false, finished_ = false, restoring_ = false;
  std::map<int64_t, Clock::time_point> down_;      // server index → when it was declared dead
  std::map<int64_t, std::vector<int64_t>> lists_;  // roll-back: checkpointed clocks per server
  int64_t restore_index_ = -1, rollback_clock_ = 0, restored_ = 0;
  uint32_t generation_ = 0;
  int64_t servers_lost_ = 0, failovers_ = 0, rollbacks_ = 0;
  int exit_code_ = 1;
  int32_t lead_ = -1;
  int64_t servers_acked_ = 0, workers_lost_ = 0, workers_joined_ = 0;
  Clock::time_point last_worker_seen_ = Clock::now(), last_rebalance_ = Clock::now(),
                    finish_started_ = Clock::now();
};

}  // namespace

int run_scheduler(const SchedulerArgs& args) {
  Scheduler s(args);
  return s.run();
}

}  // namespace moetrain::ps
