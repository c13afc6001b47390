// The scheduler's state and its handlers, shared by scheduler.cpp (registration, heartbeats,
// assignment, the end of the job) and scheduler_servers.cpp (server failures: promotion of a
// backup, a new backup for a promoted primary, replacement and roll-back; the primaries' rounds
// of an update's global figures). Internal to src/ps.
#pragma once
#include <zmq.hpp>

#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "io/run_lock.h"
#include "moe/placement.h"
#include "ps/capacity_rounds.h"
#include "ps/global_norm.h"
#include "ps/job_events.h"
#include "ps/job_plan.h"
#include "ps/membership.h"
#include "ps/scheduler.h"
#include "ps/transport.h"

namespace moetrain::ps {

// The scheduler's ROUTER on a context of its own, bound at construction. A server binds one at
// its start, so that, elected, it runs the scheduler at an address every node already knows.
struct SchedulerSocket {
  explicit SchedulerSocket(const std::string& bind);
  zmq::context_t ctx;
  zmq::socket_t router;
  std::string endpoint;
};

class Scheduler {
 public:
  using Clock = std::chrono::steady_clock;

  // Binds args.bind, or runs on `socket` when one is given.
  explicit Scheduler(const SchedulerArgs& a, std::unique_ptr<SchedulerSocket> socket = nullptr);
  int run();

 private:
  void handle(const Incoming& in);
  void on_register(const Incoming& in);
  bool on_server_lost(Node& n);
  void begin_restore(int64_t index);
  int64_t shard_without_backup();
  bool attach_spare();
  void backup_attached(const Node& b, const std::string& cause);
  void on_checkpoint_list(const Node& n, const nlohmann::json& j);
  void on_restored();
  // cause: why the rows move now (a worker lost or joined, the start), for the decision's record.
  void replan(const std::string& cause);
  void maybe_rebalance();
  void on_rejoin(const Incoming& in, const nlohmann::json& j);
  bool maybe_take_over();
  nlohmann::json heartbeat_ack(const Node& n);
  void record_election();
  void on_rows_ready(const Node& n, const nlohmann::json& j);
  void broadcast_setup();
  void maybe_finish();
  void on_finish_ack(Node& n);
  void shutdown_all(const std::string& reason);
  void begin_stop(int signal);
  bool advance_stop();
  void on_stop_checkpoint(const Node& n, const nlohmann::json& j);
  void on_norm_report(const Node& n, const Incoming& in);
  bool check_norm_rounds();
  // model.capacity = dynamic (scheduler_capacity.cpp).
  void on_capacity_report(const Node& n, const nlohmann::json& j);
  bool decide_capacity();
  void send_capacity(const Node& w, int64_t clock, const nlohmann::json& state,
                     const nlohmann::json& loads);
  void record_placement(int64_t clock);
  void capacity_rewound(int64_t clock, const char* why);
  std::filesystem::path capacity_record() const;

  SchedulerArgs args_;
  RunLock lock_;  // RUN_DIR's, for the life of the job (a standby holds none)
  std::unique_ptr<SchedulerSocket> socket_;
  zmq::socket_t& router_;
  std::string endpoint_;
  RejectStats rejects_;
  Membership members_;
  JobEvents events_;
  int32_t next_id_ = 0;
  int64_t total_keys_ = 0, global_rows_ = 0, epoch_ = 0;
  std::vector<int64_t> rows_;
  // A capability rebalance being agreed on: the new split and each worker's next clock. id: 2 ×
  // the epoch it was asked in (a stop's pause in the same epoch asks 2 × epoch + 1); a worker's
  // answer names it, and every setup names the newest query settled (applied, or dropped by a
  // re-plan or a takeover: rows_settled_), so that a worker group's ranks answer a query once,
  // together, at one clock (ps/worker_control.cpp), and answers of an older one count for nothing.
  struct RowsQuery {
    int64_t id = 0;
    RowSplit split;
    std::map<int32_t, int64_t> next_clock;  // node id → the clock it would start next
  };
  std::optional<RowsQuery> rows_query_;
  int64_t rows_from_ = -1, rows_settled_ = -1;
  // A standby taking over from a dead scheduler: the nodes that registered again, their rows.
  bool taking_over_ = false;
  Clock::time_point takeover_started_ = Clock::now();
  std::map<int64_t, int64_t> rejoin_rows_;  // worker index → rows
  std::set<uint32_t> rejoin_generations_;   // the servers' roll-back generations  // the current
                                           // split applies from this clock (−1: at once)
  bool started_ = false, finishing_ = false, finished_ = false, restoring_ = false;
  std::map<int64_t, Clock::time_point> down_;      // server index → when it was declared dead
  std::map<int64_t, std::vector<int64_t>> lists_;  // roll-back: checkpointed clocks per server
  // The server being replaced; −1 with restoring_: every server, when a resumed job starts.
  int64_t restore_index_ = -1, rollback_clock_ = 0, restored_ = 0;
  // A stop asked by a signal: the workers pause before their next clock (RowsQuery), then every
  // primary checkpoints its range, asked again until all of them stand at the same clock in two
  // rounds in a row (a paused worker's last push may still be on its way to a server).
  enum class Stop { None, Pausing, Checkpointing };
  Stop stop_ = Stop::None;
  int stop_signal_ = 0;
  Clock::time_point stop_started_ = Clock::now(), stop_asked_ = Clock::now();
  std::set<int32_t> paused_;                      // workers paused for the stop
  std::map<int64_t, int64_t> stop_versions_;      // server index → its version when it checkpointed
  int64_t stop_agreed_ = -1;  // the clock every server stood at in the last round, or -1
  uint32_t generation_ = 0;
  // optim.grad_clip, grad.expert_reweight over several servers: each sync update's parts
  // (ps/global_norm.h),
  // and who reported to each round still open (answered when it is decided).
  NormRounds norm_rounds_;
  std::map<std::tuple<uint32_t, int64_t, int>, std::vector<std::string>> norm_waiting_;
  // model.capacity = dynamic: the controllers, and the first clock each worker node computes
  // (a worker takes part in a clock's round from the clock it first asked factors for).
  CapacityRounds capacity_;
  std::string start_error_;  // what the workers that started cannot run (the quorum over groups)
  // placement.spare_slots in a sync job: the groups' planner, mirrored for the record.
  std::optional<PlacementPlanner> placement_mirror_;
  std::map<int32_t, int64_t> capacity_from_;
  std::string capacity_error_;  // set when the controllers' state cannot be rebuilt: the job stops
  int64_t capacity_takeover_clock_ = 0;  // the clock after the dead scheduler's last decision
  int64_t servers_lost_ = 0, failovers_ = 0, rollbacks_ = 0, backups_attached_ = 0;
  int exit_code_ = 1;
  int32_t lead_ = -1;
  int64_t servers_acked_ = 0, workers_lost_ = 0, workers_joined_ = 0;
  Clock::time_point last_worker_seen_ = Clock::now(), last_rebalance_ = Clock::now(),
                    finish_started_ = Clock::now();
};

inline double since(Scheduler::Clock::time_point t) {
  return std::chrono::duration<double>(Scheduler::Clock::now() - t).count();
}

}  // namespace moetrain::ps
