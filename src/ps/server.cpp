#include "ps/server.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "core/check.h"
#include "core/log.h"
#include "io/file.h"
#include "io/metrics.h"
#include "model/params.h"
#include "ps/election.h"
#include "ps/server_rounds.h"
#include "ps/job_events.h"
#include "ps/kv_server.h"
#include "ps/node.h"
#include "ps/options.h"
#include "ps/server_checkpoint.h"
#include "ps/server_update.h"
#include "train/step_metrics.h"

namespace fs = std::filesystem;

namespace moetrain::ps {

namespace {

struct ExpertSlice {
  int64_t offset;  // relative to the key range
  int64_t layer, expert;
};

class Server {
 public:
  explicit Server(const ServerArgs& a) : args_(a), kv_(ctx_, a.bind) {
    // Without a standby, this server may be elected to run the scheduler (ps/election.h).
    if (args_.standby.empty()) succession_ = std::make_unique<Succession>(successor_bind(a.bind));
    const std::string successor = succession_ ? succession_->endpoint() : "";
    link_ = std::make_unique<NodeLink>(
        ctx_, args_.scheduler, "server",
        nlohmann::json{{"endpoint", kv_.endpoint()}, {"successor", successor}}, args_.standby);
    link_->set_rejoin_state([this, successor] {
      return nlohmann::json{{"endpoint", kv_.endpoint()}, {"index", index_},
                            {"primary", primary_},        {"clock", kv_.version()},
                            {"epoch", epoch_},            {"generation", generation_},
                            {"successor", successor}};
    });
    link_->set_elect([this](const nlohmann::json& why) {
      if (!succession_ || !first_setup_done_) return false;
      succession_->take_over(cfg_, opts_, why);
      return true;
    });
    rounds_ = std::make_unique<ServerRounds>(*link_);
    index_ = link_->index();
    who_ = index_ >= 0 ? fmt::format("ps server {}", index_) : "ps server (spare)";
    kv_.set_name(who_);
    rounds_->set_name(who_);
    if (index_ < 0)
      log_info("{}: the job has its servers; waiting as a spare to replace one that dies", who_);
  }

  int run() {
    bool ok = false;
    // The first setup: the key range, the config, the options.
    while (!ok) {
      auto in = link_->next_control(1000, &ok);
      if (in && in->header.kind_enum() == Kind::Setup) {
        on_setup(in->json());
        break;
      }
    }
    while (!ok) {
      try {
        if (auto in = rounds_->next_deferred()) {
          ok = on_control(*in);
          continue;
        }
        kv_.poll(link_->socket(), 50);
        link_->check();
        while (!ok && !rounds_->has_deferred()) {
          auto in = try_receive(link_->socket(), false, link_->rejects(), who_);
          if (!in) break;
          ok = on_control(*in);
        }
      } catch (const UpdateAbandoned&) {
      }
    }
    return 0;
  }

 private:
  // Returns true when the job is over.
  bool on_control(const Incoming& in) {
    const Kind k = in.header.kind_enum();
    if (k == Kind::Setup) {
      on_setup(in.json());
    } else if (k == Kind::Finish) {
      // The final state with its optimizer moments, from which `--resume` with more steps goes
      // on (the lead worker's checkpoint holds the parameters only).
      if (primary_) {
        const std::vector<int64_t> clocks = list_server_checkpoints(run_dir_, index_);
        if (std::find(clocks.begin(), clocks.end(), kv_.version()) == clocks.end())
          write_checkpoint(kv_.version());
        write_summary();
      }
      send(link_->socket(), json_frame(Kind::FinishAck, link_->node_id(), {}));
    } else if (k == Kind::CheckpointQuery) {
      // {write: true}: the job is stopping; checkpoint the state as it stands.
      std::vector<int64_t> clocks = list_server_checkpoints(run_dir_, index_);
      const int64_t version = kv_.version();
      if (in.json().value("write", false) && primary_ &&
          std::find(clocks.begin(), clocks.end(), version) == clocks.end()) {
        write_checkpoint(version);
        clocks = list_server_checkpoints(run_dir_, index_);
      }
      send(link_->socket(), json_frame(Kind::CheckpointList, link_->node_id(),
                                       {{"clocks", clocks}, {"version", version}}));
    } else if (k == Kind::Restore) {
      const nlohmann::json j = in.json();
      restore(j.at("clock").get<int64_t>(), j.at("generation").get<uint32_t>());
      send(link_->socket(),
           json_frame(Kind::Restored, link_->node_id(), {{"clock", kv_.version()}}));
    } else if (k == Kind::Shutdown) {
      nlohmann::json j = in.json();
      MOETRAIN_CHECK(j.value("ok", false), "the scheduler stopped the job: {}",
                     j.value("reason", std::string()));
      return true;
    }
    return false;
  }

  void on_setup(const nlohmann::json& j) {
    const bool primary = j.value("replica", "primary") == "primary";
    epoch_ = j.at("epoch").get<int64_t>();
    generation_ = j.at("generation").get<int64_t>();
    if (!kv_.started()) start(j, primary);
    const bool was_primary = primary_;
    primary_ = primary;
    if (primary_ && !was_primary && first_setup_done_)
      log_warn("{}: promoted from backup to primary at clock {}", who_, kv_.version());
    first_setup_done_ = true;
    lead_ = primary_ && index_ == 0;
    // A promoted backup of server 0 goes on with the job's metrics. Lines past the state it holds
    // are of updates that died with the old primary before reaching this backup: they are applied
    // again (and written again), so they are dropped rather than left twice in the file.
    if (lead_ && !metrics_.active() && !resume_pending_)
      metrics_ = MetricsWriter::resume(run_dir_, kv_.version(), cfg_.train.tensorboard);
    // This primary's backup, if any.
    std::string backup;
    if (primary_)
      for (const auto& s : j.at("servers"))
        if (s.at("index").get<int64_t>() == index_) backup = s.value("backup", "");
    if (kv_.set_backup(backup) && backup.empty() && primary_)
      log_warn("{}: no backup any more; continuing without a replica", who_);
    std::vector<int64_t> active;
    for (const auto& w : j.at("workers")) active.push_back(w.at("index").get<int64_t>());
    kv_.set_active(active);
  }

  void start(const nlohmann::json& j, bool primary) {
    // A spare learns its index when it takes a dead server's place.
    index_ = j.at("index").get<int64_t>();
    who_ = fmt::format("ps server {}", index_);
    kv_.set_name(who_);
    rounds_->set_name(who_);
    cfg_ = run_config_from_json(j.at("config"), "the scheduler's setup message");
    opts_ = PsOptions::from_json(j.at("options"));
    check_ps_run_config(cfg_, opts_);
    const nlohmann::json& r = j.at("ranges").at(static_cast<std::size_t>(index_));
    begin_ = r.at(0).get<int64_t>(), end_ = r.at(1).get<int64_t>();
    ParamLayout layout(cfg_.model);
    MOETRAIN_CHECK(end_ <= layout.size() ||
                       (begin_ <= layout.size() && end_ == job_keys(cfg_)),
                   "keys [{}, {}): the keys past the parameters [{}, {}) (router biases, expert "
                   "token counts) must lie in one server's range; use fewer --servers for this "
                   "model",
                   begin_, end_, layout.size(), job_keys(cfg_));
    for (const auto& l : layout.layers)
      if (l.w1 >= 0) {
        const int64_t per = cfg_.model.expert_hidden * cfg_.model.dim;
        for (int64_t e = 0; e < cfg_.model.n_experts; ++e)
          for (int64_t base : {l.w1, l.w3, l.w2}) {
            const int64_t off = base + e * per;
            if (off >= begin_ && off < end_)
              experts_.push_back(
                  {off - begin_, static_cast<int64_t>(&l - layout.layers.data()), e});
          }
      }
    contributors_.assign(static_cast<std::size_t>(cfg_.model.n_layers * cfg_.model.n_experts), 0);
    run_dir_ = cfg_.train.run_dir;
    config_hash_ = cfg_.config_hash();
    fs::create_directories(fs::path(run_dir_) / "ps");
    // Only a new job's first setup starts the metrics; a replacement server appends, and a
    // resumed job's lead goes on from the clock it restores.
    resume_pending_ = j.value("resume", false);
    if (index_ == 0 && j.at("epoch").get<int64_t>() == 1 && primary && !resume_pending_)
      metrics_ = MetricsWriter(run_dir_, MetricsWriter::Open::Fresh, cfg_.train.tensorboard);
    ConsistencyConfig rules;
    rules.mode = opts_.consistency_kind();
    rules.quorum = opts_.quorum;
    rules.staleness = opts_.staleness;
    rules.workers_at_start = opts_.workers;
    update_ = std::make_unique<ServerUpdate>(cfg_, opts_, begin_, end_, *rounds_);
    update_->set_name(who_);
    KvServerHandlers h;
    h.update = [this](const UpdateInput& in, float* values) { return update(in, values); };
    h.replay = [this](float* sum, double lr, std::string_view side, float* values) {
      update_->replayed_side(side);
      update_->step(sum, lr, values, "a replayed update", -1, -1, kv_.generation());
    };
    h.side_input = [this] { return update_->side_input(); };
    h.save_state = [this] { return update_->save_state(); };
    h.load_state = [this](const RuleState& st) { update_->load_state(st); };
    h.applied = [this](const UpdateApplied& a) { applied(a); };
    h.push_ranges = [this](const std::vector<Span>& ranges) { count_contributors(ranges); };
    kv_.start(index_, begin_, end_, update_->init_state(), rules, std::move(h));
    log_info("{}: keys [{}, {}) ({} floats), {} consistency, {}", who_, begin_, end_, end_ - begin_,
             opts_.consistency, j.value("replica", "primary"));
  }

  // The update rule the store applies: one optimizer step with the summed gradient.
  double update(const UpdateInput& in, float* values) {
    const double lr = update_->lr(in.schedule_step);
    update_->step(in.sum, lr, values, fmt::format("clock {}", in.clock), in.version, in.clock,
                  kv_.generation());
    return lr;
  }

  void applied(const UpdateApplied& a) {
    if (primary_ && opts_.checkpoint_every > 0 && a.version % opts_.checkpoint_every == 0)
      write_checkpoint(a.version);
    if (primary_) write_apply_line(a);
    if (!lead_) return;
    nlohmann::json line = {{"step", a.version},     {"loss", a.loss},     {"lr", a.lr},
                           {"clock", a.clock},      {"pushes", a.pushes}, {"rows", a.rows},
                           {"time", unix_seconds()}};
    add_norm(line);
    if (cfg_.grad.sparse_experts) line["experts_frozen"] = update_->frozen_experts();
    const Consistency mode = opts_.consistency_kind();
    if (applies_per_push(mode)) line["worker"] = a.worker;
    // Pushes dropped since the last update (late for an applied clock, or of an older
    // generation) were computed by the workers and never applied.
    const KvServerStats& s = kv_.stats();
    const int64_t dropped = s.late_dropped + s.stale_dropped - dropped_before_;
    dropped_before_ = s.late_dropped + s.stale_dropped;
    line["grad_accum_efficiency"] = grad_accum_efficiency(static_cast<double>(a.pushes + dropped),
                                                          static_cast<double>(dropped));
    metrics_.write(line);
  }

  // RUN_DIR/metrics/server_I.jsonl: this primary's apply rate (updates applied by this process
  // over the seconds since its first) and the pushes still waiting.
  void write_apply_line(const UpdateApplied& a) {
    const double now = unix_seconds();
    if (!role_metrics_.active()) {
      role_metrics_ = MetricsWriter::role(run_dir_, fmt::format("server_{}", index_));
      first_apply_ = now;
    }
    ++applied_;
    nlohmann::json line = {{"step", a.version},   {"time", now},
                           {"clock", a.clock},    {"pushes", a.pushes},
                           {"updates", applied_}, {"pending", kv_.rules().pending_pushes()}};
    if (applied_ > 1 && now > first_apply_)
      line["updates_per_s"] = static_cast<double>(applied_ - 1) / (now - first_apply_);
    if (a.worker >= 0) line["worker"] = a.worker;
    add_norm(line);
    role_metrics_.write(line);
  }

  // The update's gradient norm (over the whole gradient: this range's with one server, the
  // scheduler's sum with several) and the clip scale it applied (1 when it did not clip).
  void add_norm(nlohmann::json& line) const {
    if (opts_.consistency_kind() == Consistency::Average) return;  // the pushes are parameters
    line[cfg_.optim.grad_clip > 0 || opts_.servers == 1 ? "grad_norm" : "range_grad_norm"] =
        update_->last_norm();
    if (cfg_.optim.grad_clip > 0) line["clip_scale"] = update_->last_scale();
  }

  void write_checkpoint(int64_t version) {
    write_server_checkpoint(run_dir_, index_, version, begin_, end_, kv_.values().data(),
                            update_->optimizer(), kv_.rules().worker_clocks(), config_hash_, 3,
                            update_->rule_state());
  }

  // Every server of the job goes back to the same clock (the scheduler's Restore): after a
  // replacement, or when a resumed job starts.
  void restore(int64_t clock, uint32_t generation) {
    const int64_t from = kv_.version();
    if (clock == 0) {
      kv_.restore(0, generation, update_->init_state(), {});
    } else {
      ServerCheckpoint c = read_server_checkpoint(server_checkpoint_path(run_dir_, index_, clock),
                                                  begin_, end_, config_hash_);
      restore_optimizer(c, update_->optimizer());
      update_->restore_rule_state(c.rule_state, "the checkpoint of clock " + std::to_string(clock));
      kv_.restore(clock, generation, std::move(c.params), std::move(c.worker_clocks));
    }
    if (resume_pending_) {
      resume_pending_ = false;
      log_info("{}: resumed at the checkpoint of clock {}", who_, clock);
      if (lead_ && !metrics_.active())
        metrics_ = MetricsWriter::resume(run_dir_, clock, cfg_.train.tensorboard);
      return;
    }
    ++rollbacks_;
    log_warn("{}: rolled back from clock {} to the checkpoint of clock {} (generation {})", who_,
             from, clock, generation);
    if (lead_)
      metrics_.write(
          {{"rollback_to", clock}, {"generation", generation}, {"time", unix_seconds()}});
  }

  void count_contributors(const std::vector<Span>& ranges) {
    std::vector<char> seen(contributors_.size(), 0);
    for (const ExpertSlice& e : experts_) {
      auto it = std::upper_bound(ranges.begin(), ranges.end(), e.offset,
                                 [](int64_t v, const Span& s) { return v < s.offset; });
      if (it == ranges.begin()) continue;
      --it;
      if (e.offset < it->offset + it->size)
        seen[static_cast<std::size_t>(e.layer * cfg_.model.n_experts + e.expert)] = 1;
    }
    for (std::size_t i = 0; i < seen.size(); ++i) contributors_[i] += seen[i];
  }

  void write_summary() {
    const KvServerStats& s = kv_.stats();
    nlohmann::json blocked = nlohmann::json::object();
    for (auto [w, c] : s.blocked_pulls) blocked[std::to_string(w)] = c;
    // Pushes computed by the workers that no update applied.
    const double accum_eff = grad_accum_efficiency(
        static_cast<double>(s.pushes), static_cast<double>(s.late_dropped + s.stale_dropped));
    nlohmann::json j = {{"index", index_},
                        {"keys", {begin_, end_}},
                        {"updates", kv_.version()},
                        {"pushes", s.pushes},
                        {"late_dropped", s.late_dropped},
                        {"stale_generation_dropped", s.stale_dropped},
                        {"grad_accum_efficiency", accum_eff},
                        {"refused", s.refused},
                        {"max_staleness", kv_.rules().max_staleness()},
                        {"blocked_pulls", blocked},
                        {"rejected_messages", kv_.rejects().rejected},
                        {"last_rejection", kv_.rejects().last_reason},
                        {"push_bytes", s.push_bytes},
                        {"dense_push_bytes", s.dense_push_bytes},
                        {"pulls", s.pulls},
                        {"pull_bytes", s.pull_bytes},
                        {"dense_pull_bytes", s.dense_pull_bytes},
                        {"rollbacks", rollbacks_},
                        {"updates_replicated_in", s.replicated_in},
                        {"snapshots_in", s.snapshots_in},
                        {"snapshots_out", s.snapshots_out},
                        {"expert_contributors", contributors_}};
    write_file_atomic(fs::path(run_dir_) / "ps" / fmt::format("server_{}.json", index_),
                      j.dump(2) + "\n");
    log_info(
        "{}: {} updates, {} pushes ({} late, dropped), {} bad messages rejected, largest "
        "staleness {}",
        who_, kv_.version(), s.pushes, s.late_dropped, kv_.rejects().rejected,
        kv_.rules().max_staleness());
  }

  ServerArgs args_;
  zmq::context_t ctx_;
  KvServer kv_;
  // Declared before link_, so that it outlives this server's heartbeats: an elected scheduler
  // thread ends once it has ended the job.
  std::unique_ptr<Succession> succession_;
  std::unique_ptr<NodeLink> link_;
  std::string who_, run_dir_, config_hash_;
  RunConfig cfg_;
  PsOptions opts_;
  int64_t index_ = -1, begin_ = 0, end_ = 0;
  std::unique_ptr<ServerUpdate> update_;  // the range's update rule (made at the first setup)
  std::vector<ExpertSlice> experts_;
  std::vector<int64_t> contributors_;
  MetricsWriter role_metrics_;  // RUN_DIR/metrics/server_I.jsonl, once this process applied
  int64_t applied_ = 0;
  int64_t dropped_before_ = 0;  // pushes dropped up to the last metrics line
  double first_apply_ = 0;
  MetricsWriter metrics_;  // the lead primary's (server 0): the job's metrics.jsonl
  bool lead_ = false, primary_ = false, first_setup_done_ = false;
  bool resume_pending_ = false;  // a resumed job's first Restore has not come yet
  int64_t epoch_ = 0, generation_ = 0;  // of the latest setup, for a standby scheduler
  int64_t rollbacks_ = 0;
  std::unique_ptr<ServerRounds> rounds_;  // the scheduler's rounds of an update's figures
};

}  // namespace

int run_server(const ServerArgs& args) {
  Server s(args);
  return s.run();
}

}  // namespace moetrain::ps
