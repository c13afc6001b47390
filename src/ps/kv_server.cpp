#include "ps/kv_server.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/log.h"

namespace moetrain::ps {

KvServer::KvServer(zmq::context_t& ctx, const std::string& bind)
    : ctx_(ctx), router_(ctx, zmq::socket_type::router) {
  endpoint_ = bind_router(ctx_, router_, bind);
}

void KvServer::start(int64_t index, int64_t begin, int64_t end, std::vector<float> values,
                     const ConsistencyConfig& rules, KvServerHandlers handlers) {
  MOETRAIN_CHECK(end - begin == static_cast<int64_t>(values.size()), "keys [{}, {}) with {} values",
                 begin, end, values.size());
  index_ = index;
  begin_ = begin;
  end_ = end;
  values_ = std::move(values);
  sum_.assign(values_.size(), 0.0f);
  rules_ = ConsistencyRules(rules);
  handlers_ = std::move(handlers);
  started_ = true;
}

void KvServer::set_active(const std::vector<int64_t>& workers) {
  rules_.set_active(workers);
  apply_ready();
  serve_pulls();
}

bool KvServer::set_backup(const std::string& endpoint) {
  if (endpoint == backup_endpoint_) return false;
  backup_.reset();
  backup_endpoint_ = endpoint;
  if (!endpoint.empty()) {
    backup_ = std::make_unique<zmq::socket_t>(make_dealer(ctx_, endpoint));
    // At the job's start the backup holds the same initial state; a backup attached later
    // (after a promotion) does not, and no pull is answered until it confirmed the snapshot.
    if (rules_.version() == 0) {
      replicated_ = 0;
    } else {
      replicated_ = -1;
      send_snapshot();
    }
  }
  return true;
}

void KvServer::restore(int64_t clock, uint32_t generation, std::vector<float> values,
                       std::map<int64_t, int64_t> worker_clocks) {
  MOETRAIN_CHECK(values.size() == values_.size(), "restore of {} values into keys [{}, {})",
                 values.size(), begin_, end_);
  values_ = std::move(values);
  for (int64_t id : rules_.restore(clock, std::move(worker_clocks))) pushes_.erase(id);
  replicated_ = clock;
  generation_ = generation;
  pulls_.clear();
}

void KvServer::poll(zmq::socket_t& also, int64_t timeout_ms) {
  zmq::pollitem_t items[3] = {{also.handle(), 0, ZMQ_POLLIN, 0},
                              {router_.handle(), 0, ZMQ_POLLIN, 0},
                              {backup_ ? backup_->handle() : nullptr, 0, ZMQ_POLLIN, 0}};
  poll_sockets(items, backup_ ? 3 : 2, timeout_ms);
  while (auto in = try_receive(router_, true, rejects_, who_)) on_data(*in);
  while (backup_) {
    auto in = try_receive(*backup_, false, rejects_, who_);
    if (!in) break;
    if (in->header.kind_enum() == Kind::ReplicateAck) {
      replicated_ = std::max(replicated_, in->header.clock);
      serve_pulls();
    }
  }
}

void KvServer::on_data(Incoming& in) {
  const Header& h = in.header;
  try {
    MOETRAIN_CHECK(started_, "{} before the job started", kind_name(h.kind_enum()));
    if (h.kind_enum() == Kind::Push) {
      on_push(in);
    } else if (h.kind_enum() == Kind::Pull) {
      MOETRAIN_CHECK(h.encoding() != Encoding::Json, "a pull must ask for f32, bf16 or int8 values");
      PendingPull pull{in.identity, h, {}};
      if (h.flags & kSparseFlag)
        read_ranges(in.payload, h.bytes, static_cast<int64_t>(values_.size()), pull.ranges);
      if (h.generation < generation_) {
        ++stats_.stale_dropped;
        return;
      }
      pulls_.push_back(std::move(pull));
      if (!ready(h)) ++stats_.blocked_pulls[h.sender];
      serve_pulls();
    } else if (h.kind_enum() == Kind::Replicate) {
      on_replicate(in);
    } else if (h.kind_enum() == Kind::Snapshot) {
      on_snapshot(in);
    } else {
      MOETRAIN_FAIL("a {} message is not for a server", kind_name(h.kind_enum()));
    }
  } catch (const Error& e) {
    ++rejects_.rejected;
    rejects_.last_reason = e.what();
    log_warn("{}: rejected a {} from {}: {}", who_, kind_name(h.kind_enum()), h.sender, e.what());
  }
}

void KvServer::on_push(Incoming& in) {
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
  stats_.push_bytes += static_cast<int64_t>(sizeof(Header) + h.bytes);
  stats_.dense_push_bytes += static_cast<int64_t>(sizeof(Header)) + 4 * n;
  ++stats_.pushes;
  if (handlers_.push_ranges) handlers_.push_ranges(ranges);
  send_to(router_, in.identity, ack(h));
  if (h.generation < generation_) {
    ++stats_.stale_dropped;
    return;
  }
  const int64_t id = next_push_id_++;
  switch (rules_.push(h.sender, h.clock, id, group_size_of(h.flags))) {
    case PushFate::NotActive:
      ++stats_.refused;
      log_warn("{}: push from worker {} which is not active; ignored", who_, h.sender);
      return;
    case PushFate::Late:
      ++stats_.late_dropped;
      return;
    case PushFate::Queued:
    case PushFate::Ready:
      pushes_.emplace(id, std::move(p));
      break;
  }
  apply_ready();
  serve_pulls();
}

// A backup applies its primary's update exactly as the primary did.
void KvServer::on_replicate(const Incoming& in) {
  const Header& h = in.header;
  const int64_t n = end_ - begin_;
  // The payload: the sum (n f32), then aux0 bytes of the rule's side input.
  MOETRAIN_CHECK(h.key_begin == begin_ && h.key_end == end_ && h.encoding() == Encoding::F32 &&
                     h.aux0 >= 0 && h.bytes == static_cast<uint64_t>(4 * n + h.aux0),
                 "replicate for keys [{}, {}) with {} bytes ({} of side input), this server "
                 "holds [{}, {})",
                 h.key_begin, h.key_end, h.bytes, h.aux0, begin_, end_);
  MOETRAIN_CHECK(h.clock == rules_.version(), "replicate of clock {}, this backup is at clock {}",
                 h.clock, rules_.version());
  MOETRAIN_CHECK(std::isfinite(h.value) && h.value >= 0, "replicate with lr {}", h.value);
  std::memcpy(sum_.data(), in.payload, static_cast<std::size_t>(4 * n));
  if (rules_.config().mode == Consistency::Average)
    std::copy(sum_.begin(), sum_.end(), values_.begin());
  else
    handlers_.replay(sum_.data(), h.value,
                     std::string_view(in.payload + 4 * n, static_cast<std::size_t>(h.aux0)),
                     values_.data());
  rules_.replayed(h.aux1, h.ticket, group_size_of(h.flags));
  ++stats_.replicated_in;
  Header a;
  a.kind = static_cast<uint16_t>(Kind::ReplicateAck);
  a.sender = static_cast<int32_t>(index_);
  a.clock = rules_.version();
  send_to(router_, in.identity, encode(a, {}));
}

// This server's whole state to its (new) backup, ahead of the updates that follow.
void KvServer::send_snapshot() {
  const RuleState st = handlers_.save_state();
  const std::map<int64_t, int64_t> clocks = rules_.worker_clocks();
  const std::size_t n = values_.size();
  Header h;
  h.kind = static_cast<uint16_t>(Kind::Snapshot);
  h.sender = static_cast<int32_t>(index_);
  h.flags = static_cast<uint32_t>(Encoding::F32);
  h.clock = rules_.version();
  h.key_begin = begin_;
  h.key_end = end_;
  h.aux0 = st.steps;
  h.aux1 = static_cast<int64_t>(st.buffers.size());
  h.generation = generation_;
  h.ticket = static_cast<int64_t>(st.extra.size());  // its bytes close the payload
  zmq::message_t m =
      new_frame(h, 4 * n * (1 + st.buffers.size()) + 16 * clocks.size() + st.extra.size());
  char* p = static_cast<char*>(frame_payload(m));
  std::memcpy(p, values_.data(), 4 * n);
  p += 4 * n;
  for (const auto& b : st.buffers) {
    MOETRAIN_CHECK(b.size() == n, "a state buffer of {} values for keys [{}, {})", b.size(), begin_,
                   end_);
    std::memcpy(p, b.data(), 4 * n);
    p += 4 * n;
  }
  for (auto [w, c] : clocks) {
    const int64_t pair[2] = {w, c};
    std::memcpy(p, pair, 16);
    p += 16;
  }
  std::memcpy(p, st.extra.data(), st.extra.size());
  seal(m.data(), m.size());
  send(*backup_, std::move(m));
  ++stats_.snapshots_out;
  log_info("{}: sent its state at clock {} to its new backup {}", who_, h.clock, backup_endpoint_);
}

// A new backup takes its primary's whole state; the primary's updates follow.
void KvServer::on_snapshot(const Incoming& in) {
  const Header& h = in.header;
  const uint64_t n = static_cast<uint64_t>(end_ - begin_);
  MOETRAIN_CHECK(h.key_begin == begin_ && h.key_end == end_ && h.encoding() == Encoding::F32,
                 "snapshot for keys [{}, {}), this server holds [{}, {})", h.key_begin, h.key_end,
                 begin_, end_);
  MOETRAIN_CHECK(h.aux1 >= 0 && h.aux1 <= 16 && h.aux0 >= 0 && h.clock >= 0,
                 "snapshot with {} state buffers, {} rule steps at clock {}", h.aux1, h.aux0,
                 h.clock);
  const uint64_t dense = 4 * n * (1 + static_cast<uint64_t>(h.aux1));
  const auto extra = static_cast<uint64_t>(h.ticket);
  MOETRAIN_CHECK(h.ticket >= 0 && h.bytes >= dense + extra && (h.bytes - dense - extra) % 16 == 0,
                 "snapshot of {} bytes for {} values, {} state buffers and {} bytes of rule state",
                 h.bytes, n, h.aux1, h.ticket);
  const char* p = in.payload;
  std::memcpy(values_.data(), p, 4 * n);
  p += 4 * n;
  RuleState st;
  st.steps = h.aux0;
  st.buffers.resize(static_cast<std::size_t>(h.aux1), std::vector<float>(n));
  for (auto& b : st.buffers) {
    std::memcpy(b.data(), p, 4 * n);
    p += 4 * n;
  }
  std::map<int64_t, int64_t> clocks;
  for (uint64_t k = 0; k < (h.bytes - dense - extra) / 16; ++k) {
    int64_t pair[2];
    std::memcpy(pair, p, 16);
    p += 16;
    clocks[pair[0]] = pair[1];
  }
  st.extra.assign(p, extra);
  handlers_.load_state(st);
  for (int64_t id : rules_.restore(h.clock, std::move(clocks))) pushes_.erase(id);
  generation_ = h.generation;
  ++stats_.snapshots_in;
  log_info("{}: took its primary's state at clock {}", who_, h.clock);
  Header a;
  a.kind = static_cast<uint16_t>(Kind::ReplicateAck);
  a.sender = static_cast<int32_t>(index_);
  a.clock = rules_.version();
  send_to(router_, in.identity, encode(a, {}));
}

std::string KvServer::ack(const Header& req) const {
  Header h;
  h.kind = static_cast<uint16_t>(Kind::PushAck);
  h.sender = static_cast<int32_t>(index_);
  h.ticket = req.ticket;
  h.clock = rules_.version();
  h.generation = generation_;
  return encode(h, {});
}

void KvServer::apply_ready() {
  while (auto u = rules_.next_update()) {
    try {
      apply(*u);
    } catch (...) {
      // An async push the rules handed out is gone from them; a sync clock stays pending.
      if (u->worker >= 0)
        for (int64_t id : u->ids) pushes_.erase(id);
      throw;
    }
  }
}

void KvServer::apply(const Update& u) {
  std::vector<PushView> in;
  for (int64_t id : u.ids) {
    const Push& p = pushes_.at(id);
    in.push_back({p.grads, p.rows, p.global_rows, p.loss});
  }
  const int64_t n = end_ - begin_;
  const SumResult s = sum_pushes(in, n, sum_.data());
  // average: the pushes carried parameters and their sum is the row-weighted mean.
  double lr = 0;
  if (rules_.config().mode == Consistency::Average)
    std::copy(sum_.begin(), sum_.end(), values_.begin());
  else
    lr = handlers_.update({u.version, u.clock, rules_.schedule_step(), sum_.data(), n},
                          values_.data());
  if (backup_) replicate(u.version, lr, u.worker, u.worker_clock, u.group_size);
  for (int64_t id : rules_.applied(u)) pushes_.erase(id);
  if (handlers_.applied)
    handlers_.applied({rules_.version(), u.clock, lr, static_cast<int64_t>(u.ids.size()), s.rows,
                       s.loss, u.worker});
}

// The exact input of the update rule just applied, to the backup.
void KvServer::replicate(int64_t version, double lr, int64_t worker, int64_t worker_clock,
                         int64_t group_size) {
  Header h;
  h.kind = static_cast<uint16_t>(Kind::Replicate);
  h.sender = static_cast<int32_t>(index_);
  h.flags = static_cast<uint32_t>(Encoding::F32) | group_flags(group_size);
  h.clock = version;
  h.key_begin = begin_;
  h.key_end = end_;
  h.value = lr;
  h.aux1 = worker;
  h.ticket = worker_clock;
  h.generation = generation_;
  const std::string side = handlers_.side_input ? handlers_.side_input() : std::string();
  h.aux0 = static_cast<int64_t>(side.size());
  zmq::message_t m = new_frame(h, sum_.size() * 4 + side.size());
  std::memcpy(frame_payload(m), sum_.data(), sum_.size() * 4);
  std::memcpy(frame_payload(m) + sum_.size() * 4, side.data(), side.size());
  seal(m.data(), m.size());
  send(*backup_, std::move(m));
}

bool KvServer::ready(const Header& pull) const {
  // A reply shows only updates the backup holds too, so none a worker saw can be lost.
  if (backup_ && replicated_ < rules_.version()) return false;
  return rules_.pull_ready(pull.sender, pull.clock);
}

void KvServer::serve_pulls() {
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
    h.clock = rules_.version();
    h.generation = generation_;
    h.aux0 = rules_.pull_answered(r.sender, r.clock);
    // The values in the encoding the pull asked for (checked on arrival); they stay f32 here.
    const Encoding enc = r.encoding();
    const auto n = static_cast<int64_t>(values_.size());
    // A sparse pull is answered in a sparse push's form: its ranges, then their values.
    const bool sparse = (r.flags & kSparseFlag) != 0;
    const std::vector<Span>* ranges = sparse ? &it->ranges : nullptr;
    h.flags = static_cast<uint32_t>(enc) | (sparse ? kSparseFlag : 0u);
    zmq::message_t m = new_frame(h, push_payload_size(enc, n, ranges));
    write_push(enc, values_.data(), n, ranges, nullptr, static_cast<char*>(frame_payload(m)));
    seal(m.data(), m.size());
    stats_.pull_bytes += static_cast<int64_t>(m.size());
    stats_.dense_pull_bytes += static_cast<int64_t>(sizeof(Header)) + 4 * n;
    ++stats_.pulls;
    send_to(router_, it->identity, std::move(m));
    it = pulls_.erase(it);
  }
}

}  // namespace moetrain::ps
