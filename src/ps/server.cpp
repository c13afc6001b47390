#include "ps/server.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "core/check.h"
#include "core/log.h"
#include "io/file.h"
#include "model/params.h"
#include "optim/clip.h"
#include "optim/param_groups.h"
#include "ps/node.h"
#include "ps/options.h"
#include "ps/server_checkpoint.h"

namespace fs = std::filesystem;

namespace moetrain::ps {

namespace {

struct Push {
  zmq::message_t frame;          // a dense f32 push: the gradient is read where it arrived
  std::vector<float> owned;      // other encodings: decoded here
  const float* grads = nullptr;  // (key range)
  int64_t rows = 0, global_rows = 0;
  double loss = 0;
};

struct ExpertSlice {
  int64_t offset;  // relative to the key range
  int64_t layer, expert;
};

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

class Server {
 public:
  explicit Server(const ServerArgs& a) : args_(a), router_(ctx_, zmq::socket_type::router) {
    endpoint_ = bind_router(router_, args_.bind);
    link_ = std::make_unique<NodeLink>(ctx_, args_.scheduler, "server",
                                       nlohmann::json{{"endpoint", endpoint_}});
    index_ = link_->index();
    who_ = index_ >= 0 ? fmt::format("ps server {}", index_) : "ps server (spare)";
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
      zmq::pollitem_t items[3] = {{router_.handle(), 0, ZMQ_POLLIN, 0},
                                  {link_->socket().handle(), 0, ZMQ_POLLIN, 0},
                                  {backup_ ? backup_->handle() : nullptr, 0, ZMQ_POLLIN, 0}};
      poll_sockets(items, backup_ ? 3 : 2, 50);
      link_->check();
      while (auto in = try_receive(router_, true, rejects_, who_)) on_data(*in);
      while (backup_) {
        auto in = try_receive(*backup_, false, rejects_, who_);
        if (!in) break;
        if (in->header.kind_enum() == Kind::ReplicateAck) {
          replicated_ = std::max(replicated_, in->header.clock);
          serve_pulls();
        }
      }
      while (auto in = try_receive(link_->socket(), false, link_->rejects(), who_))
        ok = on_control(*in);
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
      if (primary_) write_summary();
      send(link_->socket(), json_frame(Kind::FinishAck, link_->node_id(), {}));
    } else if (k == Kind::CheckpointQuery) {
      std::vector<int64_t> clocks = list_server_checkpoints(run_dir_, index_);
      send(link_->socket(),
           json_frame(Kind::CheckpointList, link_->node_id(), {{"clocks", clocks}}));
    } else if (k == Kind::Restore) {
      const nlohmann::json j = in.json();
      restore(j.at("clock").get<int64_t>(), j.at("generation").get<uint32_t>());
      send(link_->socket(), json_frame(Kind::Restored, link_->node_id(), {{"clock", version_}}));
    } else if (k == Kind::Shutdown) {
      nlohmann::json j = in.json();
      MOETRAIN_CHECK(j.value("ok", false), "the scheduler stopped the job: {}",
                     j.value("reason", std::string()));
      return true;
    }
    return false;
  }

  void on_setup(const nlohmann::json& j) {
    if (!opt_) {
      // A spare learns its index when it takes a dead server's place.
      index_ = j.at("index").get<int64_t>();
      who_ = fmt::format("ps server {}", index_);
      cfg_ = run_config_from_json(j.at("config"), "the scheduler's setup message");
      check_ps_run_config(cfg_);
      opts_ = PsOptions::from_json(j.at("options"));
      mode_ = opts_.consistency_kind();
      const nlohmann::json& r = j.at("ranges").at(static_cast<std::size_t>(index_));
      begin_ = r.at(0).get<int64_t>(), end_ = r.at(1).get<int64_t>();
      const int64_t n = end_ - begin_;
      ParamLayout layout(cfg_.model);
      init_state();
      sum_.assign(static_cast<std::size_t>(n), 0.0f);
      workers_at_start_ = opts_.workers;
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
      // Only the job's first setup starts the metrics; a replacement server appends.
      if (index_ == 0 && j.at("epoch").get<int64_t>() == 1 &&
          j.value("replica", "primary") == "primary")
        std::ofstream(fs::path(run_dir_) / "metrics.jsonl", std::ios::trunc);
      log_info("{}: keys [{}, {}) ({} floats), {} consistency, {}", who_, begin_, end_, n,
               opts_.consistency, j.value("replica", "primary"));
    }
    const bool was_primary = primary_;
    primary_ = j.value("replica", "primary") == "primary";
    if (primary_ && !was_primary && first_setup_done_)
      log_warn("{}: promoted from backup to primary at clock {}", who_, version_);
    first_setup_done_ = true;
    lead_ = primary_ && index_ == 0;
    // This primary's backup, if any.
    std::string backup;
    if (primary_)
      for (const auto& s : j.at("servers"))
        if (s.at("index").get<int64_t>() == index_) backup = s.value("backup", "");
    if (backup != backup_endpoint_) {
      backup_.reset();
      backup_endpoint_ = backup;
      if (!backup.empty()) {
        // Backups are attached when the job starts (or restores), both at the same state.
        backup_ = std::make_unique<zmq::socket_t>(make_dealer(ctx_, backup));
        replicated_ = version_;
      } else if (primary_) {
        log_warn("{}: no backup any more; continuing without a replica", who_);
      }
    }
    active_.clear();
    for (const auto& w : j.at("workers")) active_.push_back(w.at("index").get<int64_t>());
    std::sort(active_.begin(), active_.end());
    for (auto it = clocks_.begin(); it != clocks_.end();)
      it = std::find(active_.begin(), active_.end(), it->first) == active_.end() ? clocks_.erase(it)
                                                                                 : std::next(it);
    try_apply();
    serve_pulls();
  }

  // The state of clock 0: the run's initialisation of this range, a fresh optimizer.
  void init_state() {
    ParamLayout layout(cfg_.model);
    std::vector<float> full(static_cast<std::size_t>(layout.size()));
    init_params(full.data(), layout, cfg_.model, cfg_.train.seed);
    params_.assign(full.begin() + begin_, full.begin() + end_);
    groups_ = param_groups(layout);
    opt_ = make_optimizer(cfg_.optim.optimizer_config(), groups_, begin_, end_);
    schedule_ = std::make_unique<LrSchedule>(cfg_.optim.schedule_config(cfg_.train.steps));
  }

  // Every server of the job goes back to the same clock; what was pending belongs to the clocks
  // being undone, and messages of the older generation that still arrive are dropped.
  void restore(int64_t clock, uint32_t generation) {
    const int64_t from = version_;
    if (clock == 0) {
      init_state();
      clocks_.clear();
    } else {
      ServerCheckpoint c = read_server_checkpoint(server_checkpoint_path(run_dir_, index_, clock),
                                                  begin_, end_, config_hash_);
      params_ = std::move(c.params);
      restore_optimizer(c, *opt_);
      clocks_ = c.worker_clocks;
    }
    version_ = clock;
    replicated_ = clock;
    generation_ = generation;
    pending_.clear();
    pulls_.clear();
    ++rollbacks_;
    log_warn("{}: rolled back from clock {} to the checkpoint of clock {} (generation {})", who_,
             from, clock, generation);
    if (lead_)
      std::ofstream(fs::path(run_dir_) / "metrics.jsonl", std::ios::app)
          << nlohmann::json{{"rollback_to", clock},
                            {"generation", generation},
                            {"time", unix_seconds()}}
                 .dump()
          << "\n";
  }

  bool is_active(int64_t w) const {
    return std::find(active_.begin(), active_.end(), w) != active_.end();
  }

  void on_data(Incoming& in) {
    const Header& h = in.header;
    try {
      MOETRAIN_CHECK(opt_, "{} before the job started", kind_name(h.kind_enum()));
      if (h.kind_enum() == Kind::Push) {
        on_push(in);
      } else if (h.kind_enum() == Kind::Pull) {
        if (h.generation < generation_) {
          ++stale_dropped_;
          return;
        }
        pulls_.push_back({in.identity, h});
        if (!ready(h)) ++blocked_[h.sender];
        serve_pulls();
      } else if (h.kind_enum() == Kind::Replicate) {
        on_replicate(in);
      } else {
        MOETRAIN_FAIL("a {} message is not for a server", kind_name(h.kind_enum()));
      }
    } catch (const Error& e) {
      ++rejects_.rejected;
      rejects_.last_reason = e.what();
      log_warn("{}: rejected a {} from {}: {}", who_, kind_name(h.kind_enum()), h.sender, e.what());
    }
  }

  void on_push(Incoming& in) {
    const Header& h = in.header;
    const int64_t n = end_ - begin_;
    MOETRAIN_CHECK(h.key_begin == begin_ && h.key_end == end_,
                   "push for keys [{}, {}), this server holds [{}, {})", h.key_begin, h.key_end,
                   begin_, end_);
    MOETRAIN_CHECK(h.aux0 >= 1 && h.aux1 >= h.aux0, "push with {} of {} rows", h.aux0, h.aux1);
    MOETRAIN_CHECK(std::isfinite(h.value), "push with loss {}", h.value);
    Push p;
    std::vector<Span> ranges;
    if (h.encoding() == Encoding::F32 && !(h.flags & kSparseFlag) &&
        reinterpret_cast<uintptr_t>(in.payload) % alignof(float) == 0) {
      MOETRAIN_CHECK(h.bytes == static_cast<uint64_t>(4 * n),
                     "{} values in none take {} bytes, the message has {}", n, 4 * n, h.bytes);
      ranges.push_back({0, n});
      p.frame = std::move(in.frame);
      p.grads = reinterpret_cast<const float*>(p.frame.data<char>() + sizeof(Header));
    } else {
      p.owned.resize(static_cast<std::size_t>(n));
      decode_push(h, in.payload, n, p.owned.data(), &ranges);
      p.grads = p.owned.data();
    }
    p.rows = h.aux0, p.global_rows = h.aux1, p.loss = h.value;
    bytes_in_ += static_cast<int64_t>(sizeof(Header) + h.bytes);
    dense_bytes_ += static_cast<int64_t>(sizeof(Header)) + 4 * n;
    ++pushes_;
    count_contributors(ranges);
    send_to(router_, in.identity, ack(h));
    if (h.generation < generation_) {
      ++stale_dropped_;
      return;
    }
    if (!is_active(h.sender)) {
      ++refused_;
      log_warn("{}: push from worker {} which is not active; ignored", who_, h.sender);
      return;
    }
    if (mode_ == Consistency::Sync || mode_ == Consistency::Quorum) {
      if (h.clock < version_) {
        ++late_dropped_;
        return;
      }
      pending_[h.clock][h.sender] = std::move(p);
      try_apply();
    } else {
      int64_t& c = clocks_[h.sender];
      c = std::max(c, h.clock + 1);
      std::vector<std::pair<int64_t, const Push*>> one = {{h.sender, &p}};
      apply(one, h.clock, h.sender, c);
    }
    serve_pulls();
  }

  // A backup applies its primary's update exactly as the primary did.
  void on_replicate(const Incoming& in) {
    const Header& h = in.header;
    const int64_t n = end_ - begin_;
    MOETRAIN_CHECK(h.key_begin == begin_ && h.key_end == end_ && h.encoding() == Encoding::F32 &&
                       h.bytes == static_cast<uint64_t>(4 * n),
                   "replicate for keys [{}, {}) with {} bytes, this server holds [{}, {})",
                   h.key_begin, h.key_end, h.bytes, begin_, end_);
    MOETRAIN_CHECK(h.clock == version_, "replicate of clock {}, this backup is at clock {}",
                   h.clock, version_);
    MOETRAIN_CHECK(std::isfinite(h.value) && h.value >= 0, "replicate with lr {}", h.value);
    std::memcpy(sum_.data(), in.payload, h.bytes);
    opt_->step(params_.data(), sum_.data(), static_cast<float>(h.value));
    ++version_;
    if (h.aux1 >= 0) clocks_[h.aux1] = std::max(clocks_[h.aux1], h.ticket);
    ++replicated_in_;
    Header a;
    a.kind = static_cast<uint16_t>(Kind::ReplicateAck);
    a.sender = static_cast<int32_t>(index_);
    a.clock = version_;
    send_to(router_, in.identity, encode(a, {}));
  }

  std::string ack(const Header& req) {
    Header h;
    h.kind = static_cast<uint16_t>(Kind::PushAck);
    h.sender = static_cast<int32_t>(index_);
    h.ticket = req.ticket;
    h.clock = version_;
    h.generation = generation_;
    return encode(h, {});
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

  void try_apply() {
    for (;;) {
      auto it = pending_.find(version_);
      if (it == pending_.end() || active_.empty()) break;
      const auto& got = it->second;
      std::vector<std::pair<int64_t, const Push*>> in;
      if (mode_ == Consistency::Sync) {
        for (int64_t w : active_) {
          auto p = got.find(w);
          if (p == got.end()) return;
          in.push_back({w, &p->second});
        }
      } else {
        const auto q =
            std::min<std::size_t>(static_cast<std::size_t>(opts_.quorum), active_.size());
        if (got.size() < q) return;
        for (const auto& [w, p] : got) in.push_back({w, &p});  // std::map: worker-index order
      }
      const int64_t clock = version_;
      apply(in, clock, -1, 0);
      pending_.erase(pending_.begin(), pending_.upper_bound(clock));
    }
  }

  // One optimizer step with the sum of `in` (in worker-index order). async / ssp name the
  // pushing worker and its clock after the push, for the backup.
  void apply(const std::vector<std::pair<int64_t, const Push*>>& in, int64_t clock, int64_t worker,
             int64_t worker_clock) {
    const std::size_t n = sum_.size();
    std::copy(in[0].second->grads, in[0].second->grads + n, sum_.begin());
    int64_t rows = in[0].second->rows;
    double loss = in[0].second->loss * static_cast<double>(in[0].second->rows);
    for (std::size_t k = 1; k < in.size(); ++k) {
      const float* g = in[k].second->grads;
      for (std::size_t i = 0; i < n; ++i) sum_[i] += g[i];
      rows += in[k].second->rows;
      loss += in[k].second->loss * static_cast<double>(in[k].second->rows);
    }
    // Each worker weighted its gradient by its share of the global batch; when fewer rows than
    // the global batch arrived (a quorum, an async push, a worker lost mid-clock), rescale to
    // the mean over the rows that did.
    const int64_t global = in[0].second->global_rows;
    if (rows != global) {
      const float s = static_cast<float>(global) / static_cast<float>(rows);
      for (float& v : sum_) v *= s;
    }
    MOETRAIN_CHECK(!has_non_finite(sum_.data(), static_cast<int64_t>(n)),
                   "clock {}: non-finite gradient in keys [{}, {}); stopping. Lower optim.lr or "
                   "raise optim.warmup_steps",
                   clock, begin_, end_);
    // Async updates come one push at a time; the schedule advances once per global step.
    const int64_t step = (mode_ == Consistency::Sync || mode_ == Consistency::Quorum)
                             ? version_
                             : version_ / std::max<int64_t>(1, workers_at_start_);
    const double lr = schedule_->lr(step);
    opt_->step(params_.data(), sum_.data(), static_cast<float>(lr));
    if (backup_) replicate(version_, lr, worker, worker_clock);
    ++version_;
    if (primary_ && opts_.checkpoint_every > 0 && version_ % opts_.checkpoint_every == 0)
      write_server_checkpoint(run_dir_, index_, version_, begin_, end_, params_.data(), *opt_,
                              clocks_, config_hash_);
    if (lead_) {
      nlohmann::json line = {{"step", version_},
                             {"loss", loss / static_cast<double>(rows)},
                             {"lr", lr},
                             {"clock", clock},
                             {"pushes", in.size()},
                             {"rows", rows},
                             {"time", unix_seconds()}};
      if (mode_ == Consistency::Ssp || mode_ == Consistency::Async) line["worker"] = in[0].first;
      std::ofstream(fs::path(run_dir_) / "metrics.jsonl", std::ios::app) << line.dump() << "\n";
    }
  }

  // The exact input of the optimizer step just taken, to the backup.
  void replicate(int64_t clock, double lr, int64_t worker, int64_t worker_clock) {
    Header h;
    h.kind = static_cast<uint16_t>(Kind::Replicate);
    h.sender = static_cast<int32_t>(index_);
    h.flags = static_cast<uint32_t>(Encoding::F32);
    h.clock = clock;
    h.key_begin = begin_;
    h.key_end = end_;
    h.value = lr;
    h.aux1 = worker;
    h.ticket = worker_clock;
    h.generation = generation_;
    zmq::message_t m = new_frame(h, sum_.size() * 4);
    std::memcpy(frame_payload(m), sum_.data(), sum_.size() * 4);
    seal(m.data(), m.size());
    send(*backup_, std::move(m));
  }

  int64_t min_clock(int64_t except) const {
    int64_t m = INT64_MAX;
    for (const auto& [w, c] : clocks_)
      if (w != except) m = std::min(m, c);
    return m;
  }

  bool ready(const Header& h) const {
    // A reply shows only updates the backup holds too, so none a worker saw can be lost.
    if (backup_ && replicated_ < version_) return false;
    if (h.clock < 0) return true;  // a join or a final read: now
    switch (mode_) {
      case Consistency::Sync:
      case Consistency::Quorum:
        return version_ >= h.clock;
      case Consistency::Async:
        return true;
      case Consistency::Ssp: {
        if (!is_active(h.sender)) return true;
        const int64_t m = min_clock(-1);
        return m == INT64_MAX || m >= h.clock - opts_.staleness;
      }
    }
    return true;
  }

  void serve_pulls() {
    for (auto it = pulls_.begin(); it != pulls_.end();) {
      if (!ready(it->h)) {
        ++it;
        continue;
      }
      const Header& r = it->h;
      Header h;
      h.kind = static_cast<uint16_t>(Kind::PullReply);
      h.sender = static_cast<int32_t>(index_);
      h.ticket = r.ticket;
      h.key_begin = begin_;
      h.key_end = end_;
      h.clock = version_;
      h.generation = generation_;
      int64_t next = version_;
      if (mode_ == Consistency::Async || mode_ == Consistency::Ssp) {
        auto c = clocks_.find(r.sender);
        if (c == clocks_.end()) {
          // A joining worker starts level with the slowest, so it holds no one back.
          const int64_t m = min_clock(r.sender);
          next = m == INT64_MAX ? 0 : m;
          if (is_active(r.sender)) clocks_[r.sender] = next;
        } else {
          next = c->second;
        }
        if (mode_ == Consistency::Ssp && r.clock >= 0) {
          const int64_t m = min_clock(-1);
          if (m != INT64_MAX) max_staleness_ = std::max(max_staleness_, r.clock - m);
        }
      }
      h.aux0 = next;
      h.flags = static_cast<uint32_t>(Encoding::F32);
      zmq::message_t m = new_frame(h, params_.size() * 4);
      std::memcpy(frame_payload(m), params_.data(), params_.size() * 4);
      seal(m.data(), m.size());
      send_to(router_, it->identity, std::move(m));
      it = pulls_.erase(it);
    }
  }

  void write_summary() {
    nlohmann::json blocked = nlohmann::json::object();
    for (auto [w, c] : blocked_) blocked[std::to_string(w)] = c;
    nlohmann::json j = {{"index", index_},
                        {"keys", {begin_, end_}},
                        {"updates", version_},
                        {"pushes", pushes_},
                        {"late_dropped", late_dropped_},
                        {"stale_generation_dropped", stale_dropped_},
                        {"refused", refused_},
                        {"max_staleness", max_staleness_},
                        {"blocked_pulls", blocked},
                        {"rejected_messages", rejects_.rejected},
                        {"last_rejection", rejects_.last_reason},
                        {"push_bytes", bytes_in_},
                        {"dense_push_bytes", dense_bytes_},
                        {"rollbacks", rollbacks_},
                        {"updates_replicated_in", replicated_in_},
                        {"expert_contributors", contributors_}};
    write_file_atomic(fs::path(run_dir_) / "ps" / fmt::format("server_{}.json", index_),
                      j.dump(2) + "\n");
    log_info(
        "{}: {} updates, {} pushes ({} late, dropped), {} bad messages rejected, largest "
        "staleness {}",
        who_, version_, pushes_, late_dropped_, rejects_.rejected, max_staleness_);
  }

  ServerArgs args_;
  zmq::context_t ctx_;
  zmq::socket_t router_;
  std::unique_ptr<zmq::socket_t> backup_;
  std::string endpoint_, who_, run_dir_, backup_endpoint_, config_hash_;
  std::unique_ptr<NodeLink> link_;
  RejectStats rejects_;
  RunConfig cfg_;
  PsOptions opts_;
  Consistency mode_ = Consistency::Sync;
  int64_t index_ = -1;
  int64_t begin_ = 0, end_ = 0, version_ = 0, workers_at_start_ = 1;
  int64_t replicated_ = 0;  // the backup holds every update before this clock
  uint32_t generation_ = 0;
  std::vector<float> params_, sum_;
  std::vector<ParamRange> groups_;
  std::unique_ptr<Optimizer> opt_;
  std::unique_ptr<LrSchedule> schedule_;
  std::vector<int64_t> active_;
  std::map<int64_t, std::map<int64_t, Push>> pending_;  // clock → worker → push
  std::map<int64_t, int64_t> clocks_;                   // ssp/async: worker → pushes done
  struct PendingPull {
    std::string identity;
    Header h;
  };
  std::vector<PendingPull> pulls_;
  std::map<int64_t, int64_t> blocked_;
  std::vector<ExpertSlice> experts_;
  std::vector<int64_t> contributors_;
  bool lead_ = false, primary_ = false, first_setup_done_ = false;
  int64_t pushes_ = 0, late_dropped_ = 0, stale_dropped_ = 0, refused_ = 0, max_staleness_ = 0;
  int64_t bytes_in_ = 0, dense_bytes_ = 0, rollbacks_ = 0, replicated_in_ = 0;
};

}  // namespace

int run_server(const ServerArgs& args) {
  Server s(args);
  return s.run();
}

}  // namespace moetrain::ps
