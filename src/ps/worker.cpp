#include "ps/worker.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>
#include <thread>

#include "core/check.h"
#include "core/log.h"
#include "core/threads.h"
#include "core/timer.h"
#include "io/file.h"
#include "io/metrics.h"
#include "ps/consistency.h"
#include "ps/job_events.h"
#include "ps/kv_worker.h"
#include "ps/node.h"
#include "ps/options.h"
#include "ps/worker_step.h"

namespace fs = std::filesystem;

namespace moetrain::ps {

namespace {

// How one pass of the training loop ended.
enum class Outcome {
  Done,        // the job is complete
  RolledBack,  // the servers rolled back to a checkpoint: pull and go on from there
};

std::vector<ServerInfo> servers_of(const nlohmann::json& setup) {
  std::vector<ServerInfo> servers;
  for (const auto& s : setup.at("servers"))
    servers.push_back({s.at("index").get<int64_t>(), s.at("endpoint").get<std::string>(),
                       s.at("begin").get<int64_t>(), s.at("end").get<int64_t>()});
  return servers;
}

RowAssignment assignment_of(const nlohmann::json& setup, int64_t index) {
  for (const auto& w : setup.at("workers"))
    if (w.at("index").get<int64_t>() == index)
      return {w.at("row_begin").get<int64_t>(), w.at("rows").get<int64_t>(),
              setup.at("global_rows").get<int64_t>(), setup.at("epoch").get<int64_t>()};
  MOETRAIN_FAIL("the scheduler's setup has no rows for worker {}", index);
}

class Worker {
 public:
  explicit Worker(const WorkerArgs& a) : args_(a) {
    MOETRAIN_CHECK(std::isfinite(a.slowdown) && a.slowdown >= 1.0,
                   "--slowdown {}: must be a number ≥ 1", a.slowdown);
    check_worker_group_size(a.ep, a.world);
    // A group's ranks ask for consecutive indices, so its rows are consecutive too.
    const int64_t want = a.index >= 0 ? a.index * a.ep + a.group_rank : -1;
    link_ = std::make_unique<NodeLink>(ctx_, args_.scheduler, "worker",
                                       nlohmann::json{{"want_index", want}, {"group_size", a.ep}},
                                       args_.standby);
    link_->set_rejoin_state([this] {
      return nlohmann::json{{"done", done_},
                            {"epoch", assign_.epoch},
                            {"generation", kv_ ? kv_->generation() : 0},
                            {"group_size", args_.ep},
                            {"row_begin", assign_.row_begin},
                            {"rows", assign_.rows}};
    });
    index_ = link_->index();
    who_ = a.ep > 1 ? fmt::format("ps worker {} (rank {} of a group of {})", index_, a.group_rank,
                                  a.ep)
                    : fmt::format("ps worker {}", index_);
  }

  int run() {
    bool ok = false;
    nlohmann::json setup;
    while (setup.is_null()) {
      auto in = link_->next_control(1000, &ok);
      MOETRAIN_CHECK(!ok, "the job ended before this worker was given work");
      if (in && in->header.kind_enum() == Kind::Setup) setup = in->json();
    }
    cfg_ = run_config_from_json(setup.at("config"), "the scheduler's setup message");
    opts_ = PsOptions::from_json(setup.at("options"));
    check_ps_run_config(cfg_, opts_);
    check_worker_group(cfg_, opts_, args_.ep);
    assign_ = assignment_of(setup, index_);
    init_threads(static_cast<int>(cfg_.train.threads), args_.local_processes);
    // Collective over the group: every rank builds it once its setup came.
    if (args_.ep > 1) group_ = args_.make_group(cfg_);
    step_ = std::make_unique<WorkerStep>(cfg_, opts_, index_, args_.ep > 1 ? &group_ : nullptr);
    kv_ = std::make_unique<KvWorker>(ctx_, static_cast<int32_t>(index_), servers_of(setup),
                                     setup.at("generation").get<uint32_t>(),
                                     [this] { poll_control(); });
    if (args_.ep > 1) kv_->set_group_size(args_.ep);
    int64_t first = -1;
    while (train(first) == Outcome::RolledBack)
      log_warn("{}: the servers rolled back to clock {}; pulling and going on from there", who_,
               rollback_to_);
    return 0;
  }

 private:
  // From a pull of the current parameters to the end of the job, unless the servers roll back.
  Outcome train(int64_t& first) {
    done_ = false;
    capacity_answer_clock_ = -1;  // what was asked before a roll-back was of its generation
    WaitResult r = kv_->wait(
        kv_->pull(-1, step_->params().data(), opts_.pull_encoding(), step_->pull_keys()));
    if (group_rolled_back(r.rolled_back)) return Outcome::RolledBack;
    int64_t clock = step_->pulled(r.clock, /*fresh=*/true);
    if (first < 0) first = clock;
    log_info("{}: at clock {} with rows [{}, +{}) of {}", who_, clock, assign_.row_begin,
             assign_.rows, assign_.global_rows);
    while (clock < cfg_.train.steps) {
      // In a group every rank waits for the same clock's factors (each reports its own figures,
      // which the scheduler sums as `train` sums its ranks'); a roll-back that one rank saw while
      // waiting takes the whole group back before any of them enters the step's collectives.
      const bool rolled_back = agree_on_rows(clock, !wait_for_capacity(clock));
      if (group_rolled_back(rolled_back)) return Outcome::RolledBack;
      // The replicas of the job's loads, once every rank of the group goes on (collective).
      if (step_->placed_by_scheduler()) step_->place(clock, capacity_loads_);
      Timer step_timer;
      started_clock_ = clock;
      const PushMeta meta = compute(clock);
      // Before the push: the clock's round at the scheduler never waits for a worker whose push
      // the servers applied.
      if (clock_round())
        send_capacity_report({{"clock", clock}, {"figures", step_->capacity_figures()}}, clock + 1);
      std::vector<float>& residual = step_->residual();
      const int64_t tp = kv_->push(clock, step_->grads().data(), step_->skipped(),
                                   opts_.compression(), meta,
                                   residual.empty() ? nullptr : residual.data());
      // half_sync: a random wait between the push and the pull (ps/consistency.h).
      if (opts_.consistency_kind() == Consistency::HalfSync) {
        const double w = half_sync_wait(static_cast<uint64_t>(cfg_.train.seed), index_, clock,
                                        opts_.half_sync_wait_ms);
        std::this_thread::sleep_for(std::chrono::duration<double>(w));
        half_sync_wait_s_ += w;
      }
      const int64_t tl = kv_->pull(clock + 1, step_->params().data(), opts_.pull_encoding(),
                                   step_->pull_keys());
      // A roll-back forgets both requests: the pull's wait then returns at once.
      const bool push_rolled_back = kv_->wait(tp).rolled_back;
      r = kv_->wait(tl);
      if (group_rolled_back(push_rolled_back || r.rolled_back)) return Outcome::RolledBack;
      r.clock = step_->pulled(r.clock);
      const int64_t local = opts_.consistency_kind() == Consistency::Average ? opts_.local_steps : 1;
      write_step_line(clock, meta.rows * local, step_timer.seconds(), r.clock);
      // The servers say where to go on: the next clock, or later when this worker's push came
      // too late for a quorum, or when it joined mid-run.
      clock = std::max(clock + 1, r.clock);
      ++steps_;
    }
    write_stats(first, clock);
    done_ = true;
    send(link_->socket(), json_frame(Kind::Done, link_->node_id(),
                                     {{"clock", clock}, {"generation", kv_->generation()}}));
    // Wait for the end of the job; the lead worker writes the final checkpoint.
    bool ok = false;
    while (!ok) {
      auto in = link_->next_control(1000, &ok);
      if (!in) continue;
      if (in->header.kind_enum() == Kind::Finish && in->json().value("lead", false)) {
        // The final parameters in f32 whatever --pull-compression says: the checkpoint holds the
        // servers' values, not their wire form.
        r = kv_->wait(kv_->pull(-1, step_->params().data(), Encoding::F32));
        if (r.rolled_back) return Outcome::RolledBack;
        step_->finish(r.clock);
        send(link_->socket(), json_frame(Kind::FinishAck, link_->node_id(), {}));
      } else if (on_control(*in)) {
        return Outcome::RolledBack;
      }
    }
    return Outcome::Done;
  }

  // Whether the servers rolled back, agreed by a worker group (collective over it): a rank that
  // saw its answers arrive before its roll-back message waits for that message, so that every
  // rank goes back to the pull together and none enters a step's collectives alone. A worker
  // alone: `mine`.
  bool group_rolled_back(bool mine) {
    if (args_.ep == 1) return mine;
    int64_t any = mine ? 1 : 0;
    group_.comm->allreduce(&any, 1, {ReduceOp::Max});
    while (any != 0 && !mine) {
      bool ok = false;
      auto in = link_->next_control(100, &ok);
      MOETRAIN_CHECK(!ok, "the job ended while this worker's group rolled back");
      if (in) mine = on_control(*in);
    }
    return any != 0;
  }

  // While a wait blocks. A roll-back resets the KvWorker, whose wait then returns rolled_back.
  void poll_control() {
    link_->check();
    while (auto in = try_receive(link_->socket(), false, link_->rejects(), who_)) on_control(*in);
  }

  // A new row split applies from one clock on for every worker: asked (RowsQuery), a worker
  // answers with the next clock it would start, finishes the clock it is in and waits; the
  // scheduler takes the largest clock any worker would start next and sends the split with that
  // clock (rows_from_clock), so no clock is computed with the old split by one worker and the new
  // one by another. A group's ranks get the query at different moments, possibly while one of
  // them waits for the others inside a step's collective, so they decide to wait only here,
  // between two clocks, and together: they agree (collective) on the newest query any of them
  // got and the oldest settlement any of them saw, and all wait (a rank that has not got the
  // query yet answers with this clock) until each holds the settling setup, or none waits.
  // `rolled_back`: whether this worker saw a roll-back before; returns whether it saw one (the group then goes
  // back without answering; the query is answered after the roll-back's pull).
  bool agree_on_rows(int64_t clock, bool rolled_back) {
    // The newest query any rank got, the oldest settlement any rank has seen (negated for Max):
    // every rank goes on only once it holds the setup that settles the newest query, so that
    // all of them switch rows at the same clock.
    int64_t q[3] = {rows_seen_, -rows_settled_, rolled_back ? 1 : 0};
    if (args_.ep > 1) group_.comm->allreduce(q, 3, {ReduceOp::Max});
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

  void answer_rows(int64_t clock, int64_t query) {
    if (query <= rows_answered_ || query <= rows_settled_) return;
    rows_answered_ = query;
    send(link_->socket(),
         json_frame(Kind::RowsReady, link_->node_id(), {{"clock", clock}, {"query", query}}));
  }

  bool capacity_dynamic() const { return cfg_.model.capacity == CapacityMode::Dynamic; }
  // The scheduler's round of each clock: the capacity factors, or the job's loads that a group's
  // replicas are placed from (ps/capacity_rounds.h).
  bool clock_round() const { return capacity_dynamic() || step_->placed_by_scheduler(); }

  // model.capacity = dynamic (ps/capacity_rounds.h): the scheduler's report of this worker's
  // figures of a clock, or its request for a clock's factors; `answer_clock`: the clock whose
  // factors answer it. Sent again every heartbeat timeout while this worker waits (a scheduler
  // that took over, or that was restoring, answers it then).
  void send_capacity_report(nlohmann::json body, int64_t answer_clock) {
    body["generation"] = kv_->generation();
    send(link_->socket(), json_frame(Kind::CapacityReport, link_->node_id(), body));
    capacity_report_ = std::move(body);
    capacity_answer_clock_ = answer_clock;
    capacity_sent_.reset();
  }

  // The controllers' state for `clock`, applied before it is computed. Returns false on a
  // roll-back.
  bool wait_for_capacity(int64_t clock) {
    if (!clock_round()) return true;
    if (capacity_answer_clock_ != clock) send_capacity_report({{"clock", clock}}, clock);
    while (capacity_clock_ != clock || capacity_generation_ != kv_->generation()) {
      bool ok = false;
      auto in = link_->next_control(100, &ok);
      MOETRAIN_CHECK(!ok, "the job ended while this worker waited for its capacity factors");
      if (in && on_control(*in)) return false;
      if (capacity_sent_.seconds() > link_->heartbeat_timeout())
        send_capacity_report(capacity_report_, capacity_answer_clock_);
    }
    if (capacity_dynamic()) step_->set_capacity(capacity_state_);
    return true;
  }

  // Returns true when the message rolled the job back to a server checkpoint.
  bool on_control(const Incoming& in) {
    const Kind k = in.header.kind_enum();
    if (k == Kind::CapacityFactors) {
      nlohmann::json j = in.json();
      capacity_clock_ = j.at("clock").get<int64_t>();
      capacity_generation_ = j.at("generation").get<uint32_t>();
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

  // Gradients of this worker's rows of step `clock` (WorkerStep), at the speed --slowdown asks
  // for; the capability the scheduler splits rows by follows the measured rate.
  PushMeta compute(int64_t clock) {
    Timer timer;
    if (next_assign_ && clock >= switch_at_) {
      assign_ = *next_assign_;
      next_assign_.reset();
    }
    const bool average = opts_.consistency_kind() == Consistency::Average;
    // average: H local steps of this worker's rows each.
    const int64_t R = assign_.rows * (average ? opts_.local_steps : 1);
    const PushMeta meta =
        average ? step_->local_round(clock, assign_) : step_->compute(clock, assign_);
    const double t = timer.seconds();
    compute_s_ += t;
    if (args_.slowdown > 1.0)
      std::this_thread::sleep_for(std::chrono::duration<double>((args_.slowdown - 1.0) * t));
    // Rows over seconds of the recent steps (each older step weighs 0.9 of the next): one step of
    // a small model is a few milliseconds, so a single step's rate is mostly noise, and the
    // capability split would follow the noise.
    rate_rows_ = 0.9 * rate_rows_ + static_cast<double>(R);
    rate_seconds_ = 0.9 * rate_seconds_ + t * args_.slowdown;
    link_->set_throughput(rate_rows_ / rate_seconds_);
    rows_done_ += R;
    return meta;
  }

  // RUN_DIR/metrics/worker_I.jsonl: the step's throughput (its rows over its wall time, compute
  // and the wait for the servers both) and the staleness of its push: how many clocks the
  // servers had gone past it when the pull after it was answered (0 in lock-step).
  void write_step_line(int64_t clock, int64_t rows, double seconds, int64_t server_clock) {
    if (!role_metrics_.active())
      role_metrics_ = MetricsWriter::role(cfg_.train.run_dir, fmt::format("worker_{}", index_));
    role_metrics_.write(
        {{"step", clock + 1},
         {"time", unix_seconds()},
         {"rows", rows},
         {"step_time_s", seconds},
         {"rows_per_s", static_cast<double>(rows) / seconds},
         {"tokens_per_s",
          static_cast<double>(rows * cfg_.train.seq_len * cfg_.train.grad_accum) / seconds},
         {"staleness", std::max<int64_t>(0, server_clock - clock - 1)}});
  }

  void write_stats(int64_t first, int64_t last) {
    nlohmann::json j = {{"index", index_},
                        {"node", link_->node_id()},
                        {"first_clock", first},
                        {"last_clock", last},
                        {"steps", steps_},
                        {"rows", rows_done_},
                        {"compute_s", compute_s_},
                        {"wait_s", kv_->wait_seconds()},
                        {"half_sync_wait_s", half_sync_wait_s_},
                        {"push_bytes", kv_->push_bytes()},
                        {"dense_push_bytes", kv_->dense_push_bytes()},
                        {"pull_bytes", kv_->pull_bytes()},
                        {"dense_pull_bytes", kv_->dense_pull_bytes()},
                        {"slowdown", args_.slowdown}};
    if (args_.ep > 1)
      j["group"] = {{"ep", args_.ep},
                    {"rank", args_.group_rank},
                    {"expert_first", group_.expert_first},
                    {"expert_count", group_.expert_count}};
    fs::path dir = fs::path(cfg_.train.run_dir) / "ps";
    fs::create_directories(dir);
    write_file_atomic(dir / fmt::format("worker_node{}.json", link_->node_id()), j.dump(2) + "\n");
    // The int8 error-feedback residual is this worker's state: a worker restarted in its place
    // (same index) could continue from it.
    if (const std::vector<float>& residual = step_->residual(); !residual.empty())
      write_file_atomic(
          dir / fmt::format("residual_worker{}.f32", index_),
          std::string_view(reinterpret_cast<const char*>(residual.data()), residual.size() * 4));
    const double saved = kv_->dense_push_bytes() > 0
                             ? 1.0 - static_cast<double>(kv_->push_bytes()) /
                                         static_cast<double>(kv_->dense_push_bytes())
                             : 0.0;
    log_info("{}: {} steps, pushed {} bytes ({:.1f}% less than dense f32), waited {:.2f} s", who_,
             steps_, kv_->push_bytes(), 100.0 * saved, kv_->wait_seconds());
  }

  WorkerArgs args_;
  zmq::context_t ctx_;
  std::unique_ptr<NodeLink> link_;
  int64_t index_ = 0;
  std::string who_;
  RunConfig cfg_;
  PsOptions opts_;
  RowAssignment assign_;
  std::optional<RowAssignment> next_assign_;  // the split from clock switch_at_ on
  int64_t switch_at_ = 0, started_clock_ = -1;
  // model.capacity = dynamic: the last CapacityReport sent and the clock its answer is for; the
  // last factors received, for which clock and generation.
  nlohmann::json capacity_report_, capacity_state_, capacity_loads_;
  int64_t capacity_answer_clock_ = -1, capacity_clock_ = -1;
  uint32_t capacity_generation_ = 0;
  Timer capacity_sent_;
  bool done_ = false;
  // Row queries (RowsQuery ids): the newest received, answered, and settled by a setup.
  int64_t rows_seen_ = -1, rows_answered_ = -1, rows_settled_ = -1;
  WorkerGroup group_;  // --ep P > 1: this rank's group (kept alive for the step's model)
  std::unique_ptr<WorkerStep> step_;
  std::unique_ptr<KvWorker> kv_;
  MetricsWriter role_metrics_;  // RUN_DIR/metrics/worker_I.jsonl, from the first step on
  int64_t steps_ = 0, rows_done_ = 0, rollback_to_ = -1;
  double compute_s_ = 0, half_sync_wait_s_ = 0;
  double rate_rows_ = 0, rate_seconds_ = 0;  // the reported throughput's running sums
};

}  // namespace

int run_worker(const WorkerArgs& args) {
  Worker w(args);
  return w.run();
}

}  // namespace moetrain::ps
