#include "ps/transport.h"

#include "core/check.h"
#include "core/log.h"
#include "ps/security.h"

#include <cstring>
#include <vector>

namespace moetrain::ps {

nlohmann::json Incoming::json() const {
  MOETRAIN_CHECK(header.encoding() == Encoding::Json,
                 "{} message does not carry JSON (flags 0x{:x})", kind_name(header.kind_enum()),
                 header.flags);
  auto j = nlohmann::json::parse(payload, payload + header.bytes, nullptr, false);
  MOETRAIN_CHECK(!j.is_discarded() && j.is_object(), "{} message carries malformed JSON",
                 kind_name(header.kind_enum()));
  return j;
}

zmq::socket_t make_dealer(zmq::context_t& ctx, const std::string& endpoint) {
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  // Large pushes must not be dropped by a high-water mark; memory is bounded by the protocol
  // (one outstanding push per server per worker).
  s.set(zmq::sockopt::sndhwm, 0);
  s.set(zmq::sockopt::rcvhwm, 0);
  secure_client(s);
  try {
    s.connect(endpoint);
  } catch (const zmq::error_t& e) {
    MOETRAIN_FAIL("cannot connect to '{}': {} (expected tcp://HOST:PORT)", endpoint, e.what());
  }
  return s;
}

std::string bind_router(zmq::context_t& ctx, zmq::socket_t& router, const std::string& endpoint) {
  router.set(zmq::sockopt::linger, 0);
  router.set(zmq::sockopt::sndhwm, 0);
  router.set(zmq::sockopt::rcvhwm, 0);
  // A peer that vanished must not block sends to the others.
  router.set(zmq::sockopt::router_mandatory, false);
  secure_server(ctx, router);
  try {
    router.bind(endpoint);
  } catch (const zmq::error_t& e) {
    MOETRAIN_FAIL("cannot bind '{}': {} (expected tcp://HOST:PORT, a free port or *)", endpoint,
                  e.what());
  }
  std::string bound = router.get(zmq::sockopt::last_endpoint);
  watch_handshakes(ctx, router, "ps " + bound);
  return bound;
}

void send(zmq::socket_t& dealer, std::string_view frame) {
  dealer.send(zmq::buffer(frame.data(), frame.size()), zmq::send_flags::none);
}

void send_to(zmq::socket_t& router, const std::string& identity, std::string_view frame) {
  router.send(zmq::buffer(identity), zmq::send_flags::sndmore);
  router.send(zmq::buffer(frame.data(), frame.size()), zmq::send_flags::none);
}

zmq::message_t new_frame(Header h, std::size_t payload_bytes) {
  zmq::message_t m(sizeof(Header) + payload_bytes);
  h.bytes = payload_bytes;
  h.checksum = 0;
  std::memcpy(m.data(), &h, sizeof(h));
  return m;
}

void send(zmq::socket_t& dealer, zmq::message_t&& frame) {
  dealer.send(frame, zmq::send_flags::none);
}

void send_to(zmq::socket_t& router, const std::string& identity, zmq::message_t&& frame) {
  router.send(zmq::buffer(identity), zmq::send_flags::sndmore);
  router.send(frame, zmq::send_flags::none);
}

std::string json_frame(Kind kind, int32_t sender, const nlohmann::json& body, int64_t clock) {
  Header h;
  h.kind = static_cast<uint16_t>(kind);
  h.sender = sender;
  h.clock = clock;
  h.flags = static_cast<uint32_t>(Encoding::Json);
  // `{}` in a call is JSON null; every message body is an object.
  return encode(h, body.is_null() ? std::string("{}") : body.dump());
}

std::optional<Incoming> try_receive(zmq::socket_t& socket, bool router, RejectStats& stats,
                                    std::string_view who) {
  zmq::message_t first;
  if (!socket.recv(first, zmq::recv_flags::dontwait)) return std::nullopt;
  std::vector<zmq::message_t> parts;
  parts.push_back(std::move(first));
  while (parts.back().more()) {
    zmq::message_t next;
    (void)socket.recv(next, zmq::recv_flags::none);
    parts.push_back(std::move(next));
  }
  const std::size_t want = router ? 2 : 1;
  Incoming in;
  std::string reason;
  if (parts.size() != want) {
    reason = fmt::format("a message of {} frames (one frame per message expected)",
                         parts.size() - (want - 1));
  } else {
    if (router) in.identity = parts[0].to_string();
    in.frame = std::move(parts.back());
    try {
      Decoded d = decode(in.frame.data(), in.frame.size());
      in.header = d.header;
      in.payload = d.payload;
      return in;
    } catch (const Error& e) {
      reason = e.what();
    }
  }
  ++stats.rejected;
  stats.last_reason = reason;
  log_warn("{}: rejected a message: {}", who, reason);
  return std::nullopt;
}

int poll_sockets(zmq::pollitem_t* items, int n, int64_t timeout_ms) {
  try {
    return zmq::poll(items, static_cast<std::size_t>(n), std::chrono::milliseconds(timeout_ms));
  } catch (const zmq::error_t& e) {
    // A signal (a stop asked with SIGINT or SIGTERM) interrupted the wait: nothing is ready;
    // the caller's loop looks at the stop request and polls again.
    if (e.num() == EINTR) return 0;
    throw;
  }
}

}  // namespace moetrain::ps
