#include "ps/worker_control.h"

#include <algorithm>

#include "core/check.h"

namespace moetrain::ps {

namespace {

RowAssignment assignment_of(const nlohmann::json& setup, int64_t index) {
  for (const auto& w : setup.at("workers"))
    if (w.at("index").get<int64_t>() == index)
      return {w.at("row_begin").get<int64_t>(), w.at("rows").get<int64_t>(),
              setup.at("global_rows").get<int64_t>(), setup.at("epoch").get<int64_t>()};
  MOETRAIN_FAIL("the scheduler's setup has no rows for worker {}", index);
}

}  // namespace

std::vector<ServerInfo> servers_of(const nlohmann::json& setup) {
  std::vector<ServerInfo> servers;
  for (const auto& s : setup.at("servers"))
    servers.push_back({s.at("index").get<int64_t>(), s.at("endpoint").get<std::string>(),
                       s.at("begin").get<int64_t>(), s.at("end").get<int64_t>()});
  return servers;
}

WorkerControl::WorkerControl(zmq::context_t& ctx, const std::string& scheduler,
                             const std::string& standby, int64_t want_index, int64_t group_size,
                             int64_t group_rank) {
  link_ = std::make_unique<NodeLink>(
      ctx, scheduler, "worker",
      nlohmann::json{{"want_index", want_index}, {"group_size", group_size}}, standby);
  link_->set_rejoin_state([this, group_size] {
    return nlohmann::json{{"done", done_},
                          {"epoch", assign_.epoch},
                          {"generation", kv_ ? kv_->generation() : 0},
                          {"group_size", group_size},
                          {"row_begin", assign_.row_begin},
                          {"rows", assign_.rows}};
  });
  index_ = link_->index();
  who_ = group_size > 1 ? fmt::format("ps worker {} (rank {} of a group of {})", index_,
                                      group_rank, group_size)
                        : fmt::format("ps worker {}", index_);
}

nlohmann::json WorkerControl::wait_for_setup() {
  bool ok = false;
  nlohmann::json setup;
  while (setup.is_null()) {
    auto in = link_->next_control(1000, &ok);
    MOETRAIN_CHECK(!ok, "the job ended before this worker was given work");
    if (in && in->header.kind_enum() == Kind::Setup) setup = in->json();
  }
  assign_ = assignment_of(setup, index_);
  return setup;
}

void WorkerControl::attach(KvWorker* kv, Comm* group, bool round) {
  kv_ = kv;
  group_ = group;
  round_ = round;
}

void WorkerControl::poll() {
  link_->check();
  while (auto in = try_receive(link_->socket(), false, link_->rejects(), who_)) on_control(*in);
}

bool WorkerControl::group_rolled_back(bool mine) {
  if (group_ == nullptr) return mine;
  int64_t any = mine ? 1 : 0;
  group_->allreduce(&any, 1, {ReduceOp::Max});
  while (any != 0 && !mine) {
    bool ok = false;
    auto in = link_->next_control(100, &ok);
    MOETRAIN_CHECK(!ok, "the job ended while this worker's group rolled back");
    if (in) mine = on_control(*in);
  }
  return any != 0;
}

bool WorkerControl::before_clock(int64_t clock) {
  // In a group every rank waits for the same clock's round (each reports its own figures, which
  // the scheduler sums as `train` sums its ranks'); a roll-back that one rank saw while waiting
  // takes the whole group back before any of them enters the step's collectives.
  return group_rolled_back(agree_on_rows(clock, !wait_for_round(clock)));
}

const RowAssignment& WorkerControl::rows_of(int64_t clock) {
  started_clock_ = clock;
  if (next_assign_ && clock >= switch_at_) {
    assign_ = *next_assign_;
    next_assign_.reset();
  }
  return assign_;
}

// A new row split applies from one clock on for every worker: asked (RowsQuery), a worker answers
// with the next clock it would start, finishes the clock it is in and waits; the scheduler takes
// the largest clock any worker would start next and sends the split with that clock
// (rows_from_clock), so no clock is computed with the old split by one worker and the new one by
// another. A group's ranks get the query at different moments, possibly while one of them waits
// for the others inside a step's collective, so they decide to wait only here, between two
// clocks, and together: they agree (collective) on the newest query any of them got and the
// oldest settlement any of them saw, and all wait (a rank that has not got the query yet answers
// with this clock) until each holds the settling setup, or none waits. `rolled_back`: whether
// this worker saw a roll-back before; returns whether it saw one (the group then goes back
// without answering; the query is answered after the roll-back's pull).
bool WorkerControl::agree_on_rows(int64_t clock, bool rolled_back) {
  // The newest query any rank got, the oldest settlement any rank has seen (negated for Max):
  // every rank goes on only once it holds the setup that settles the newest query, so that all
  // of them switch rows at the same clock.
  int64_t q[3] = {rows_seen_, -rows_settled_, rolled_back ? 1 : 0};
  if (group_ != nullptr) group_->allreduce(q, 3, {ReduceOp::Max});
  if (q[2] != 0 || q[0] <= -q[1]) return rolled_back;
  answer_rows(clock, q[0]);
  while (rows_settled_ < std::max(q[0], rows_answered_)) {
    bool ok = false;
    auto in = link_->next_control(100, &ok);
    MOETRAIN_CHECK(!ok, "the job ended while this worker waited for its rows");
    if (in && on_control(*in)) return true;
    // A newer query (a stop's) while every rank of the group waits here: answer it too.
    answer_rows(clock, rows_seen_);
  }
  return false;
}

void WorkerControl::answer_rows(int64_t clock, int64_t query) {
  if (query <= rows_answered_ || query <= rows_settled_) return;
  rows_answered_ = query;
  send(link_->socket(),
       json_frame(Kind::RowsReady, link_->node_id(), {{"clock", clock}, {"query", query}}));
}

void WorkerControl::report(int64_t clock, const nlohmann::json& figures) {
  if (round_) send_report({{"clock", clock}, {"figures", figures}}, clock + 1);
}

// The scheduler's report of this worker's figures of a clock, or its request for a clock's
// answer; `answer_clock`: the clock whose answer answers it. Sent again every heartbeat timeout
// while this worker waits (a scheduler that took over, or that was restoring, answers it then).
void WorkerControl::send_report(nlohmann::json body, int64_t answer_clock) {
  body["generation"] = kv_->generation();
  send(link_->socket(), json_frame(Kind::CapacityReport, link_->node_id(), body));
  report_ = std::move(body);
  round_answer_clock_ = answer_clock;
  report_sent_.reset();
}

// The round's answer for `clock`, before it is computed. Returns false on a roll-back.
bool WorkerControl::wait_for_round(int64_t clock) {
  if (!round_) return true;
  if (round_answer_clock_ != clock) send_report({{"clock", clock}}, clock);
  while (round_clock_ != clock || round_generation_ != kv_->generation()) {
    bool ok = false;
    auto in = link_->next_control(100, &ok);
    MOETRAIN_CHECK(!ok, "the job ended while this worker waited for its capacity factors");
    if (in && on_control(*in)) return false;
    if (report_sent_.seconds() > link_->heartbeat_timeout())
      send_report(report_, round_answer_clock_);
  }
  round_state_ = capacity_state_;
  round_loads_ = capacity_loads_;
  return true;
}

bool WorkerControl::finish(int64_t clock, const std::function<bool()>& lead_finish) {
  done_ = true;
  send(link_->socket(), json_frame(Kind::Done, link_->node_id(),
                                   {{"clock", clock}, {"generation", kv_->generation()}}));
  // Wait for the end of the job; the lead worker writes the final checkpoint.
  bool ok = false;
  while (!ok) {
    auto in = link_->next_control(1000, &ok);
    if (!in) continue;
    if (in->header.kind_enum() == Kind::Finish && in->json().value("lead", false)) {
      if (!lead_finish()) return true;
      send(link_->socket(), json_frame(Kind::FinishAck, link_->node_id(), {}));
    } else if (on_control(*in)) {
      return true;
    }
  }
  return false;
}

bool WorkerControl::on_control(const Incoming& in) {
  const Kind k = in.header.kind_enum();
  if (k == Kind::CapacityFactors) {
    nlohmann::json j = in.json();
    round_clock_ = j.at("clock").get<int64_t>();
    round_generation_ = j.at("generation").get<uint32_t>();
    capacity_state_ = std::move(j.at("state"));
    capacity_loads_ = j.value("loads", nlohmann::json::array());
  } else if (k == Kind::RowsQuery) {
    // Answered at once, wherever this worker is (a worker that waits for the servers to sum a
    // clock must not wait for the others to pause too): it computes no clock past the one it
    // names before the split is settled, as it pauses before its next one (agree_on_rows).
    rows_seen_ = std::max(rows_seen_, in.json().value("query", int64_t{-1}));
    answer_rows(started_clock_ + 1, rows_seen_);
  } else if (k == Kind::Setup) {
    const nlohmann::json j = in.json();
    rows_settled_ = std::max(rows_settled_, j.value("rows_settled", int64_t{-1}));
    const int64_t from = j.value("rows_from_clock", int64_t{-1});
    if (from >= 0) {
      next_assign_ = assignment_of(j, index_);
      switch_at_ = from;
    } else {
      assign_ = assignment_of(j, index_);
      next_assign_.reset();
    }
    const auto generation = j.at("generation").get<uint32_t>();
    if (generation != kv_->generation()) {
      kv_->reset(servers_of(j), generation);
      rollback_to_ = j.value("rollback_to", int64_t{-1});
      return true;
    }
    kv_->update_servers(servers_of(j));
  } else if (k == Kind::Shutdown) {
    nlohmann::json j = in.json();
    MOETRAIN_FAIL("the scheduler stopped the job: {}", j.value("reason", std::string()));
  }
  return false;
}

}  // namespace moetrain::ps
