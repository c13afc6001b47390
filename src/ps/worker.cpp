#include "ps/worker.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
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
#include "ps/options.h"
#include "ps/worker_control.h"
#include "ps/worker_step.h"

namespace fs = std::filesystem;

namespace moetrain::ps {

namespace {

// How one pass of the training loop ended.
enum class Outcome {
  Done,        // the job is complete
  RolledBack,  // the servers rolled back to a checkpoint: pull and go on from there
};

// The worker index to ask the scheduler for, once the arguments are checked: a group's ranks ask
// for consecutive indices, so its rows are consecutive too (−1: any).
int64_t wanted_index(const WorkerArgs& a) {
  MOETRAIN_CHECK(std::isfinite(a.slowdown) && a.slowdown >= 1.0,
                 "--slowdown {}: must be a number ≥ 1", a.slowdown);
  check_worker_group_size(a.ep, a.world);
  return a.index >= 0 ? a.index * a.ep + a.group_rank : -1;
}

class Worker {
 public:
  explicit Worker(const WorkerArgs& a)
      : args_(a),
        control_(ctx_, a.scheduler, a.standby, wanted_index(a), a.ep, a.group_rank),
        index_(control_.index()),
        who_(control_.who()) {}

  int run() {
    const nlohmann::json setup = control_.wait_for_setup();
    cfg_ = run_config_from_json(setup.at("config"), "the scheduler's setup message");
    opts_ = PsOptions::from_json(setup.at("options"));
    check_ps_run_config(cfg_, opts_);
    check_worker_group(cfg_, opts_, args_.ep);
    init_threads(static_cast<int>(cfg_.train.threads), args_.local_processes);
    // Collective over the group: every rank builds it once its setup came.
    if (args_.ep > 1) group_ = args_.make_group(cfg_);
    step_ = std::make_unique<WorkerStep>(cfg_, opts_, index_, args_.ep > 1 ? &group_ : nullptr);
    kv_ = std::make_unique<KvWorker>(ctx_, static_cast<int32_t>(index_), servers_of(setup),
                                     setup.at("generation").get<uint32_t>(),
                                     [this] { control_.poll(); });
    if (args_.ep > 1) kv_->set_group_size(args_.ep);
    // Each clock's round with the scheduler: the capacity factors, or the job's loads that a
    // group's replicas are placed from (ps/capacity_rounds.h).
    control_.attach(kv_.get(), args_.ep > 1 ? group_.comm : nullptr,
                    capacity_dynamic() || step_->placed_by_scheduler());
    int64_t first = -1;
    while (train(first) == Outcome::RolledBack)
      log_warn("{}: the servers rolled back to clock {}; pulling and going on from there", who_,
               control_.rollback_to());
    return 0;
  }

 private:
  bool capacity_dynamic() const { return cfg_.model.capacity == CapacityMode::Dynamic; }

  // From a pull of the current parameters to the end of the job, unless the servers roll back.
  Outcome train(int64_t& first) {
    control_.restart();
    WaitResult r = kv_->wait(
        kv_->pull(-1, step_->params().data(), opts_.pull_encoding(), step_->pull_keys()));
    if (control_.group_rolled_back(r.rolled_back)) return Outcome::RolledBack;
    int64_t clock = step_->pulled(r.clock, /*fresh=*/true);
    if (first < 0) first = clock;
    const RowAssignment& rows = control_.rows();
    log_info("{}: at clock {} with rows [{}, +{}) of {}", who_, clock, rows.row_begin, rows.rows,
             rows.global_rows);
    while (clock < cfg_.train.steps) {
      if (control_.before_clock(clock)) return Outcome::RolledBack;
      if (capacity_dynamic()) step_->set_capacity(control_.capacity_state());
      // The replicas of the job's loads, once every rank of the group goes on (collective).
      if (step_->placed_by_scheduler()) step_->place(clock, control_.capacity_loads());
      Timer step_timer;
      const PushMeta meta = compute(clock);
      // Before the push: the clock's round at the scheduler never waits for a worker whose push
      // the servers applied.
      control_.report(clock, step_->capacity_figures());
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
      if (control_.group_rolled_back(push_rolled_back || r.rolled_back))
        return Outcome::RolledBack;
      r.clock = step_->pulled(r.clock);
      const int64_t local = opts_.consistency_kind() == Consistency::Average ? opts_.local_steps : 1;
      write_step_line(clock, meta.rows * local, step_timer.seconds(), r.clock);
      // The servers say where to go on: the next clock, or later when this worker's push came
      // too late for a quorum, or when it joined mid-run.
      clock = std::max(clock + 1, r.clock);
      ++steps_;
    }
    write_stats(first, clock);
    // The lead worker writes the final checkpoint: the final parameters in f32 whatever
    // --pull-compression says (the checkpoint holds the servers' values, not their wire form).
    const bool rolled_back = control_.finish(clock, [&] {
      r = kv_->wait(kv_->pull(-1, step_->params().data(), Encoding::F32));
      if (r.rolled_back) return false;
      step_->finish(r.clock);
      return true;
    });
    return rolled_back ? Outcome::RolledBack : Outcome::Done;
  }

  // Gradients of this worker's rows of step `clock` (WorkerStep), at the speed --slowdown asks
  // for; the capability the scheduler splits rows by follows the measured rate.
  PushMeta compute(int64_t clock) {
    Timer timer;
    const RowAssignment& rows = control_.rows_of(clock);
    const bool average = opts_.consistency_kind() == Consistency::Average;
    // average: H local steps of this worker's rows each.
    const int64_t R = rows.rows * (average ? opts_.local_steps : 1);
    const PushMeta meta = average ? step_->local_round(clock, rows) : step_->compute(clock, rows);
    const double t = timer.seconds();
    compute_s_ += t;
    if (args_.slowdown > 1.0)
      std::this_thread::sleep_for(std::chrono::duration<double>((args_.slowdown - 1.0) * t));
    // Rows over seconds of the recent steps (each older step weighs 0.9 of the next): one step of
    // a small model is a few milliseconds, so a single step's rate is mostly noise, and the
    // capability split would follow the noise.
    rate_rows_ = 0.9 * rate_rows_ + static_cast<double>(R);
    rate_seconds_ = 0.9 * rate_seconds_ + t * args_.slowdown;
    control_.link().set_throughput(rate_rows_ / rate_seconds_);
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
                        {"node", control_.link().node_id()},
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
    write_file_atomic(dir / fmt::format("worker_node{}.json", control_.link().node_id()), j.dump(2) + "\n");
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
  WorkerControl control_;  // the scheduler's channel: rows, each clock's round, roll-backs
  int64_t index_ = 0;
  std::string who_;
  RunConfig cfg_;
  PsOptions opts_;
  WorkerGroup group_;  // --ep P > 1: this rank's group (kept alive for the step's model)
  std::unique_ptr<WorkerStep> step_;
  std::unique_ptr<KvWorker> kv_;
  MetricsWriter role_metrics_;  // RUN_DIR/metrics/worker_I.jsonl, from the first step on
  int64_t steps_ = 0, rows_done_ = 0;
  double compute_s_ = 0, half_sync_wait_s_ = 0;
  double rate_rows_ = 0, rate_seconds_ = 0;  // the reported throughput's running sums
};

}  // namespace

int run_worker(const WorkerArgs& args) {
  Worker w(args);
  return w.run();
}

}  // namespace moetrain::ps
