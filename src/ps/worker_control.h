// A worker's side of the scheduler's control channel (ps/worker.h runs the training loop over it):
// its link to the scheduler (ps/node.h), the rows of each step it computes and a new split's
// switch-over at one clock for every worker, each clock's round with the scheduler (capacity
// factors or the job's loads: ps/capacity_rounds.h), and the servers' roll-backs to a checkpoint,
// agreed by the ranks of a worker group before any of them enters a step's collectives.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "core/comm.h"
#include "core/timer.h"
#include "ps/kv_worker.h"
#include "ps/node.h"
#include "ps/worker_step.h"

namespace moetrain::ps {

std::vector<ServerInfo> servers_of(const nlohmann::json& setup);

class WorkerControl {
 public:
  // Registers with the scheduler. want_index: the worker index asked for (−1: any); group_size:
  // the processes of this worker's group.
  WorkerControl(zmq::context_t& ctx, const std::string& scheduler, const std::string& standby,
                int64_t want_index, int64_t group_size, int64_t group_rank);

  int64_t index() const { return index_; }
  const std::string& who() const { return who_; }
  NodeLink& link() { return *link_; }

  // Blocks until the scheduler's setup message arrives; takes this worker's rows from it.
  nlohmann::json wait_for_setup();
  // Once the servers' client exists. group: the group's processes (null for a worker alone);
  // round: whether every clock has a round with the scheduler (ps/capacity_rounds.h).
  void attach(KvWorker* kv, Comm* group, bool round);

  // While a wait for the servers blocks: handles what the scheduler sent. A roll-back resets the
  // KvWorker, whose wait then returns rolled_back.
  void poll();
  // Whether the servers rolled back, agreed by a worker group (collective over it): a rank that
  // saw its answers arrive before its roll-back message waits for that message, so that every
  // rank goes back to the pull together. A worker alone: `mine`.
  bool group_rolled_back(bool mine);
  // Before computing `clock`: the row split agreed (a pending query settled for every worker of
  // the group) and this clock's round answered. Returns true on a roll-back.
  bool before_clock(int64_t clock);
  // The rows of `clock`, switching to a new split from the clock it applies at; marks the clock
  // as started (a row query is answered with the one after it).
  const RowAssignment& rows_of(int64_t clock);
  const RowAssignment& rows() const { return assign_; }
  // This worker's figures of `clock` for the clock's round (sent before the push).
  void report(int64_t clock, const nlohmann::json& figures);
  // The last round's answer: the capacity controllers' state and the job's loads.
  const nlohmann::json& capacity_state() const { return round_state_; }
  const nlohmann::json& capacity_loads() const { return round_loads_; }

  // The job's end: tells the scheduler this worker is done at `clock`; then waits for the job to
  // finish, calling `lead_finish` when the scheduler asks this worker to write the final
  // checkpoint (false: the servers rolled back meanwhile). Returns true on a roll-back.
  bool finish(int64_t clock, const std::function<bool()>& lead_finish);
  void restart() {
    done_ = false;
    round_answer_clock_ = -1;  // what was asked before a roll-back was of its generation
  }
  int64_t rollback_to() const { return rollback_to_; }

 private:
  bool agree_on_rows(int64_t clock, bool rolled_back);
  void answer_rows(int64_t clock, int64_t query);
  void send_report(nlohmann::json body, int64_t answer_clock);
  bool wait_for_round(int64_t clock);
  bool on_control(const Incoming& in);  // true when the message rolled the job back

  std::unique_ptr<NodeLink> link_;
  int64_t index_ = 0;
  std::string who_;
  KvWorker* kv_ = nullptr;
  Comm* group_ = nullptr;
  bool round_ = false;
  RowAssignment assign_;
  std::optional<RowAssignment> next_assign_;  // the split from clock switch_at_ on
  int64_t switch_at_ = 0, started_clock_ = -1;
  // The clock's round: the last report sent and the clock its answer is for; the last answer
  // received, for which clock and generation.
  nlohmann::json report_, capacity_state_, capacity_loads_;
  nlohmann::json round_state_, round_loads_;  // the answer of the clock before_clock settled
  int64_t round_answer_clock_ = -1, round_clock_ = -1;
  uint32_t round_generation_ = 0;
  Timer report_sent_;
  bool done_ = false;
  // Row queries (RowsQuery ids): the newest received, answered, and settled by a setup.
  int64_t rows_seen_ = -1, rows_answered_ = -1, rows_settled_ = -1;
  int64_t rollback_to_ = -1;
};

}  // namespace moetrain::ps
