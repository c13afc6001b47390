#include "ps/kv_worker.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "core/log.h"
#include "core/timer.h"

namespace moetrain::ps {

KvWorker::KvWorker(zmq::context_t& ctx, int32_t worker_index, std::vector<ServerInfo> servers,
                   uint32_t generation, std::function<void()> on_idle)
    : ctx_(ctx),
      index_(worker_index),
      generation_(generation),
      servers_(std::move(servers)),
      on_idle_(std::move(on_idle)) {
  sockets_.resize(servers_.size());
  last_push_.resize(servers_.size());
  for (std::size_t s = 0; s < servers_.size(); ++s) connect(s);
}

void KvWorker::connect(std::size_t s) {
  sockets_[s].reset();
  if (!servers_[s].endpoint.empty())
    sockets_[s] = std::make_unique<zmq::socket_t>(make_dealer(ctx_, servers_[s].endpoint));
}

void KvWorker::send_request(Pending& p, std::size_t s, zmq::message_t&& frame) {
  // The kept copy shares the buffer with the one ZeroMQ sends (a reference count, no copy).
  p.frames[s].copy(frame);
  if (sockets_[s]) send(*sockets_[s], std::move(frame));
}

void KvWorker::update_servers(const std::vector<ServerInfo>& servers) {
  MOETRAIN_CHECK(servers.size() == servers_.size(), "the job has {} servers, the setup lists {}",
                 servers_.size(), servers.size());
  for (std::size_t s = 0; s < servers.size(); ++s) {
    MOETRAIN_CHECK(servers[s].begin == servers_[s].begin && servers[s].end == servers_[s].end,
                   "server {}'s key range changed", s);
    if (servers[s].endpoint == servers_[s].endpoint) continue;
    log_info("ps worker {}: server {} is now at '{}'", index_, servers[s].index,
             servers[s].endpoint);
    servers_[s].endpoint = servers[s].endpoint;
    connect(s);
    if (!sockets_[s]) continue;
    if (last_push_[s].size() > 0) {
      zmq::message_t again;
      again.copy(last_push_[s]);
      send(*sockets_[s], std::move(again));
    }
    for (auto& [ticket, p] : pending_)
      if (!p.done[s] && p.params) {  // pulls; the push went above
        zmq::message_t again;
        again.copy(p.frames[s]);
        send(*sockets_[s], std::move(again));
      }
  }
}

void KvWorker::reset(const std::vector<ServerInfo>& servers, uint32_t generation) {
  pending_.clear();
  first_live_ticket_ = next_ticket_;
  for (auto& m : last_push_) m = zmq::message_t();
  generation_ = generation;
  for (std::size_t s = 0; s < servers.size(); ++s)
    if (servers[s].endpoint != servers_[s].endpoint) {
      servers_[s].endpoint = servers[s].endpoint;
      connect(s);
    }
}

int64_t KvWorker::push(int64_t clock, const float* grads, const std::vector<Span>& skip,
                       Encoding enc, const PushMeta& meta, float* residual) {
  const int64_t ticket = next_ticket_++;
  Pending& p = pending_[ticket];
  p.done.assign(servers_.size(), 0);
  p.frames.resize(servers_.size());
  for (std::size_t s = 0; s < servers_.size(); ++s) {
    const int64_t b = servers_[s].begin, e = servers_[s].end;
    // This server's part of the kept ranges: [b, e) minus the skipped ones.
    std::vector<Span> keep;
    int64_t at = b;
    bool sparse = false;
    for (const Span& k : skip) {
      const int64_t lo = std::max(k.offset, b), hi = std::min(k.offset + k.size, e);
      if (lo >= hi) continue;
      sparse = true;
      if (lo > at) keep.push_back({at - b, lo - at});
      at = hi;
    }
    if (at < e) keep.push_back({at - b, e - at});
    Header h;
    h.kind = static_cast<uint16_t>(Kind::Push);
    h.sender = index_;
    h.flags = static_cast<uint32_t>(enc) | (sparse ? kSparseFlag : 0u) | group_flags(group_size_);
    h.clock = clock;
    h.key_begin = b;
    h.key_end = e;
    h.ticket = ticket;
    h.aux0 = meta.rows;
    h.aux1 = meta.global_rows;
    h.value = meta.loss;
    h.generation = generation_;
    const std::vector<Span>* ranges = sparse ? &keep : nullptr;
    zmq::message_t m = new_frame(h, push_payload_size(enc, e - b, ranges));
    write_push(enc, grads + b, e - b, ranges,
               enc == Encoding::Int8 && residual ? residual + b : nullptr, frame_payload(m));
    seal(m.data(), m.size());
    push_bytes_ += static_cast<int64_t>(m.size());
    dense_push_bytes_ += static_cast<int64_t>(sizeof(Header)) + 4 * (e - b);
    last_push_[s].copy(m);
    send_request(p, s, std::move(m));
  }
  return ticket;
}

int64_t KvWorker::pull(int64_t clock, float* params, Encoding enc, const std::vector<Span>* keys) {
  MOETRAIN_CHECK(enc != Encoding::Json, "a pull asks for values, not JSON");
  const int64_t ticket = next_ticket_++;
  Pending& p = pending_[ticket];
  p.params = params;
  p.enc = enc;
  p.done.assign(servers_.size(), 0);
  p.frames.resize(servers_.size());
  for (std::size_t s = 0; s < servers_.size(); ++s) {
    const int64_t b = servers_[s].begin, e = servers_[s].end;
    Header h;
    h.kind = static_cast<uint16_t>(Kind::Pull);
    h.sender = index_;
    h.flags = static_cast<uint32_t>(enc) | (keys ? kSparseFlag : 0u);
    h.clock = clock;
    h.key_begin = b;
    h.key_end = e;
    h.ticket = ticket;
    h.generation = generation_;
    // A sparse pull lists this server's part of the keys, relative to its range.
    std::vector<Span> want;
    if (keys)
      for (const Span& k : *keys) {
        const int64_t lo = std::max(k.offset, b), hi = std::min(k.offset + k.size, e);
        if (lo < hi) want.push_back({lo - b, hi - lo});
      }
    zmq::message_t m = new_frame(h, keys ? ranges_size(want) : 0);
    if (keys) write_ranges(want, static_cast<char*>(frame_payload(m)));
    seal(m.data(), m.size());
    send_request(p, s, std::move(m));
  }
  return ticket;
}

void KvWorker::receive_all() {
  for (std::size_t s = 0; s < sockets_.size(); ++s) {
    if (!sockets_[s]) continue;
    while (auto in = try_receive(*sockets_[s], false, rejects_, "ps worker")) {
      const Header& h = in->header;
      auto it = pending_.find(h.ticket);
      // Forgotten by a roll-back, or answered already by the server this one replaced.
      if (it == pending_.end() || it->second.done[s]) continue;
      Pending& p = it->second;
      if (h.kind_enum() == Kind::PullReply) {
        const int64_t n = servers_[s].end - servers_[s].begin;
        const bool sparse = (h.flags & kSparseFlag) != 0;
        if (!p.params || h.key_begin != servers_[s].begin || h.key_end != servers_[s].end ||
            h.encoding() != p.enc || (!sparse && h.bytes != encoded_size(p.enc, n))) {
          log_warn(
              "ps worker {}: malformed pull reply from server {} (keys [{}, {}), {} bytes of {})",
              index_, servers_[s].index, h.key_begin, h.key_end, h.bytes,
              compression_name(h.encoding()));
          continue;
        }
        if (sparse) {
          try {
            decode_push(h, in->payload, n, p.params + h.key_begin, nullptr, /*zero_rest=*/false);
          } catch (const Error& err) {
            log_warn("ps worker {}: malformed sparse pull reply from server {}: {}", index_,
                     servers_[s].index, err.what());
            continue;
          }
        } else {
          decode_values(p.enc, in->payload, h.bytes, n, p.params + h.key_begin);
        }
        pull_bytes_ += static_cast<int64_t>(in->frame.size());
        dense_pull_bytes_ += static_cast<int64_t>(sizeof(Header)) + 4 * n;
        p.clock = std::min(p.clock, h.aux0);
      } else if (h.kind_enum() == Kind::PushAck) {
        p.clock = std::min(p.clock, h.clock);
      } else {
        log_warn("ps worker {}: unexpected {} from server {}", index_, kind_name(h.kind_enum()),
                 servers_[s].index);
        continue;
      }
      p.done[s] = 1;
      p.frames[s] = zmq::message_t();
      ++p.answered;
    }
  }
}

WaitResult KvWorker::wait(int64_t ticket) {
  auto it = pending_.find(ticket);
  if (it == pending_.end() && ticket < first_live_ticket_) return {true, 0};
  MOETRAIN_CHECK(it != pending_.end(), "wait on unknown ticket {}", ticket);
  Timer t;
  for (;;) {
    receive_all();
    if (it->second.answered >= static_cast<int64_t>(servers_.size())) break;
    on_idle_();  // may re-route (update_servers) or roll back (reset)
    it = pending_.find(ticket);
    if (it == pending_.end()) {
      wait_s_ += t.seconds();
      return {true, 0};
    }
    std::vector<zmq::pollitem_t> items;
    for (auto& s : sockets_)
      if (s) items.push_back({s->handle(), 0, ZMQ_POLLIN, 0});
    poll_sockets(items.data(), static_cast<int>(items.size()), 20);
  }
  const int64_t clock = it->second.clock;
  pending_.erase(it);
  wait_s_ += t.seconds();
  return {false, clock};
}

}  // namespace moetrain::ps
