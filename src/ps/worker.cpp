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
#include "data/loader.h"
#include "data/shard.h"
#include "io/checkpoint.h"
#include "io/file.h"
#include "io/metrics.h"
#include "model/transformer.h"
#include "ps/job_events.h"
#include "ps/kv_worker.h"
#include "ps/node.h"
#include "ps/options.h"
#include "train/accumulate.h"
#include "train/evaluate.h"

namespace fs = std::filesystem;

namespace moetrain::ps {

namespace {

struct Assignment {
  int64_t row_begin = 0, rows = 0, global_rows = 0, epoch = 0;
};

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

Assignment assignment_of(const nlohmann::json& setup, int64_t index) {
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
    link_ = std::make_unique<NodeLink>(ctx_, args_.scheduler, "worker",
                                       nlohmann::json{{"want_index", a.index}}, args_.standby);
    link_->set_rejoin_state([this] {
      return nlohmann::json{{"done", done_},
                            {"epoch", assign_.epoch},
                            {"generation", kv_ ? kv_->generation() : 0},
                            {"row_begin", assign_.row_begin},
                            {"rows", assign_.rows}};
    });
    index_ = link_->index();
    who_ = fmt::format("ps worker {}", index_);
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
    check_ps_run_config(cfg_);
    opts_ = PsOptions::from_json(setup.at("options"));
    assign_ = assignment_of(setup, index_);
    init_threads(static_cast<int>(cfg_.train.threads));
    model_ = std::make_unique<Transformer>(cfg_.model);
    const int64_t P = model_->layout().size();
    params_.assign(static_cast<std::size_t>(P), 0.0f);
    grads_.assign(params_.size(), 0.0f);
    // A worker started in place of a dead one begins with a zero residual: see docs/ps.md.
    if (opts_.compression() == Encoding::Int8) residual_.assign(params_.size(), 0.0f);
    train_ = std::make_unique<TokenShard>(fs::path(cfg_.data.dir) / "train.bin");
    MOETRAIN_CHECK(train_->size() > static_cast<uint64_t>(cfg_.train.seq_len) + 1,
                   "{} has {} tokens, too few for train.seq_len = {}", train_->path().string(),
                   train_->size(), cfg_.train.seq_len);
    kv_ = std::make_unique<KvWorker>(ctx_, static_cast<int32_t>(index_), servers_of(setup),
                                     setup.at("generation").get<uint32_t>(),
                                     [this] { poll_control(); });
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
    WaitResult r = kv_->wait(kv_->pull(-1, params_.data()));
    if (r.rolled_back) return Outcome::RolledBack;
    int64_t clock = r.clock;
    if (first < 0) first = clock;
    log_info("{}: at clock {} with rows [{}, +{}) of {}", who_, clock, assign_.row_begin,
             assign_.rows, assign_.global_rows);
    while (clock < cfg_.train.steps) {
      if (!wait_for_rows()) return Outcome::RolledBack;
      Timer step_timer;
      started_clock_ = clock;
      const PushMeta meta = compute(clock);
      const int64_t tp = kv_->push(clock, grads_.data(), skip_, opts_.compression(), meta,
                                   residual_.empty() ? nullptr : residual_.data());
      const int64_t tl = kv_->pull(clock + 1, params_.data());
      if (kv_->wait(tp).rolled_back) return Outcome::RolledBack;
      r = kv_->wait(tl);
      if (r.rolled_back) return Outcome::RolledBack;
      write_step_line(clock, meta.rows, step_timer.seconds(), r.clock);
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
        r = kv_->wait(kv_->pull(-1, params_.data()));
        if (r.rolled_back) return Outcome::RolledBack;
        finish(r.clock);
        send(link_->socket(), json_frame(Kind::FinishAck, link_->node_id(), {}));
      } else if (on_control(*in)) {
        return Outcome::RolledBack;
      }
    }
    return Outcome::Done;
  }

  // While a wait blocks. A roll-back resets the KvWorker, whose wait then returns rolled_back.
  void poll_control() {
    link_->check();
    while (auto in = try_receive(link_->socket(), false, link_->rejects(), who_)) on_control(*in);
  }

  // A new row split applies from one clock on for every worker: asked (RowsQuery), a worker
  // finishes the clock it is in and waits; the scheduler takes the largest clock any worker would
  // start next and sends the split with that clock (rows_from_clock), so no clock is computed
  // with the old split by one worker and the new one by another. Returns false on a roll-back.
  bool wait_for_rows() {
    while (rows_paused_) {
      bool ok = false;
      auto in = link_->next_control(100, &ok);
      MOETRAIN_CHECK(!ok, "the job ended while this worker waited for its rows");
      if (in && on_control(*in)) return false;
    }
    return true;
  }

  // Returns true when the message rolled the job back to a server checkpoint.
  bool on_control(const Incoming& in) {
    const Kind k = in.header.kind_enum();
    if (k == Kind::RowsQuery) {
      rows_paused_ = true;
      send(link_->socket(),
           json_frame(Kind::RowsReady, link_->node_id(), {{"clock", started_clock_ + 1}}));
    } else if (k == Kind::Setup) {
      const nlohmann::json j = in.json();
      rows_paused_ = false;
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

  // Gradients of this worker's rows of step `clock`, weighted by their share of the global
  // batch, into grads_; records which experts got no tokens (skip_).
  PushMeta compute(int64_t clock) {
    Timer timer;
    if (next_assign_ && clock >= switch_at_) {
      assign_ = *next_assign_;
      next_assign_.reset();
    }
    const Assignment a = assign_;
    const int64_t T = cfg_.train.seq_len, A = cfg_.train.grad_accum, R = a.rows;
    const int64_t E = cfg_.model.n_experts;
    inputs_.resize(static_cast<std::size_t>(R * T));
    targets_.resize(inputs_.size());
    AccumulateArgs<TokenBatch> args;
    args.micro_batches = A;
    // This worker's rows' share of the global batch: the servers sum the workers' pushes.
    args.loss_weight =
        static_cast<float>(static_cast<double>(R) / static_cast<double>(a.global_rows * A));
    args.fill = [&](int64_t micro) {
      // Row r of the global batch is the window the single-process run draws for its row r.
      for (int64_t b = 0; b < R; ++b) {
        BatchLoader one(*train_, 1, T, cfg_.train.seed, static_cast<int>(a.row_begin + b),
                        static_cast<int>(a.global_rows));
        one.fill(clock, micro, inputs_.data() + b * T, targets_.data() + b * T);
      }
      return TokenBatch{inputs_.data(), targets_.data(), R, T};
    };
    // This worker's rows start at row_begin of the global batch.
    args.moe_step = [&](int64_t micro) {
      return micro_batch_step(cfg_.train.seed, clock, A, micro, a.row_begin * T);
    };
    args.bad_loss = [&](const LossParts& p) {
      return fmt::format(
          "clock {}: the loss is {} on worker {}; stopping. Lower optim.lr or raise "
          "optim.warmup_steps",
          clock, p.total, index_);
    };
    const Accumulated acc = accumulate(*model_, params_.data(), grads_.data(),
                                       static_cast<int64_t>(grads_.size()), args);
    skip_.clear();
    if (opts_.sparse_push) {
      const ParamLayout& layout = model_->layout();
      const int64_t per = cfg_.model.expert_hidden * cfg_.model.dim;
      for (int64_t l = 0; l < cfg_.model.n_layers; ++l) {
        const int64_t m = model_->moe_index(l);
        if (m < 0) continue;
        const LayerOffsets& o = layout.layers[l];
        const std::vector<int64_t>& load = acc.tokens_per_expert[static_cast<std::size_t>(m)];
        for (int64_t e = 0; e < E; ++e)
          if (load[static_cast<std::size_t>(e)] == 0)
            for (int64_t base : {o.w1, o.w3, o.w2}) skip_.push_back({base + e * per, per});
      }
      std::sort(skip_.begin(), skip_.end(),
                [](const Span& x, const Span& y) { return x.offset < y.offset; });
    }
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
    return {R, a.global_rows, acc.loss.total};
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
                        {"push_bytes", kv_->push_bytes()},
                        {"dense_push_bytes", kv_->dense_push_bytes()},
                        {"pull_bytes", kv_->pull_bytes()},
                        {"slowdown", args_.slowdown}};
    fs::path dir = fs::path(cfg_.train.run_dir) / "ps";
    fs::create_directories(dir);
    write_file_atomic(dir / fmt::format("worker_node{}.json", link_->node_id()), j.dump(2) + "\n");
    // The int8 error-feedback residual is this worker's state: a worker restarted in its place
    // (same index) could continue from it.
    if (!residual_.empty())
      write_file_atomic(
          dir / fmt::format("residual_worker{}.f32", index_),
          std::string_view(reinterpret_cast<const char*>(residual_.data()), residual_.size() * 4));
    const double saved = kv_->dense_push_bytes() > 0
                             ? 1.0 - static_cast<double>(kv_->push_bytes()) /
                                         static_cast<double>(kv_->dense_push_bytes())
                             : 0.0;
    log_info("{}: {} steps, pushed {} bytes ({:.1f}% less than dense f32), waited {:.2f} s", who_,
             steps_, kv_->push_bytes(), 100.0 * saved, kv_->wait_seconds());
  }

  // The lead worker: the final parameters as a normal checkpoint, and the validation loss.
  void finish(int64_t clock) {
    const ParamLayout& layout = model_->layout();
    CheckpointContents c;
    for (const auto& p : layout.params())
      c.model.push_back({p.name, p.shape, params_.data() + p.offset});
    nlohmann::json hf = cfg_.model.to_hf_json();
    if (std::string why; !cfg_.model.hf_mixtral_compatible(&why)) {
      hf["architectures"] = {"MoetrainForCausalLM"};
      hf["model_type"] = "moetrain";
      hf["moetrain_note"] =
          fmt::format("not loadable as transformers' MixtralForCausalLM: {}", why);
    }
    hf["moetrain"] = cfg_.to_json();
    c.config = hf;
    c.trainer = {{"step", clock},
                 {"config_hash", cfg_.config_hash()},
                 {"seed", cfg_.train.seed},
                 {"parameter_server", opts_.to_json()}};
    fs::path dir = write_checkpoint(cfg_.train.run_dir, clock, c, cfg_.train.keep_checkpoints);
    TokenShard val(fs::path(cfg_.data.dir) / "val.bin");
    const double v = evaluate(*model_, params_.data(), val, cfg_.train.batch_size,
                              cfg_.train.seq_len, cfg_.train.eval_batches);
    MetricsWriter(cfg_.train.run_dir, MetricsWriter::Open::Append, cfg_.train.tensorboard)
        .write({{"step", clock}, {"val_loss", v}});
    log_info("{}: final checkpoint {} (clock {}); validation loss {:.4f}", who_, dir.string(),
             clock, v);
  }

  WorkerArgs args_;
  zmq::context_t ctx_;
  std::unique_ptr<NodeLink> link_;
  int64_t index_ = 0;
  std::string who_;
  RunConfig cfg_;
  PsOptions opts_;
  Assignment assign_;
  std::optional<Assignment> next_assign_;  // the split from clock switch_at_ on
  int64_t switch_at_ = 0, started_clock_ = -1;
  bool rows_paused_ = false, done_ = false;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<TokenShard> train_;
  std::unique_ptr<KvWorker> kv_;
  MetricsWriter role_metrics_;  // RUN_DIR/metrics/worker_I.jsonl, from the first step on
  std::vector<float> params_, grads_, residual_;
  std::vector<int32_t> inputs_, targets_;
  std::vector<Span> skip_;
  int64_t steps_ = 0, rows_done_ = 0, rollback_to_ = -1;
  double compute_s_ = 0;
  double rate_rows_ = 0, rate_seconds_ = 0;  // the reported throughput's running sums
};

}  // namespace

int run_worker(const WorkerArgs& args) {
  Worker w(args);
  return w.run();
}

}  // namespace moetrain::ps
