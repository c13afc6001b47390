// ZeroMQ below the parameter server (ps-lite's Van): one frame per message on DEALER sockets,
// an identity frame first on ROUTER sockets. Receiving never throws on bad input: a frame that
// fails decode() is counted and logged, and the caller goes on serving.
#pragma once
#include <zmq.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ps/message.h"

namespace moetrain::ps {

// A received, validated message. The frame owns the bytes `payload` points into.
struct Incoming {
  std::string identity;  // ROUTER sockets: the peer's routing id
  zmq::message_t frame;
  Header header;
  const char* payload = nullptr;

  nlohmann::json json() const;  // the payload as JSON; throws naming the kind if it is not
};

// Counts what a receiver refused.
struct RejectStats {
  int64_t rejected = 0;
  std::string last_reason;
};

// Both are CURVE once security.h's use_curve() was called (the job key; see security.h), and the
// router logs every peer it refuses at the handshake.
zmq::socket_t make_dealer(zmq::context_t& ctx, const std::string& endpoint);
// Binds a ROUTER of `ctx` to `endpoint` ("tcp://HOST:PORT", or "tcp://HOST:*" for an ephemeral
// port) and returns the endpoint actually bound.
std::string bind_router(zmq::context_t& ctx, zmq::socket_t& router, const std::string& endpoint);

void send(zmq::socket_t& dealer, std::string_view frame);
void send_to(zmq::socket_t& router, const std::string& identity, std::string_view frame);

// Frames built in place (no copy of the payload on the way out): new_frame() writes the header
// (h.bytes = payload_bytes) into a message of 88 + payload_bytes bytes; the caller writes the
// payload at frame_payload(), seals it (seal() in message.h), and sends the message itself,
// which ZeroMQ's I/O thread transmits from that buffer.
zmq::message_t new_frame(Header h, std::size_t payload_bytes);
inline char* frame_payload(zmq::message_t& m) {
  return m.data<char>() + sizeof(Header);
}
void send(zmq::socket_t& dealer, zmq::message_t&& frame);
void send_to(zmq::socket_t& router, const std::string& identity, zmq::message_t&& frame);

// A JSON control message.
std::string json_frame(Kind kind, int32_t sender, const nlohmann::json& body, int64_t clock = 0);

// Receives one message if one is waiting (ROUTER when `router`); nullopt when none is, or when
// the one that came was malformed (then `stats` records why and a warning names the peer).
std::optional<Incoming> try_receive(zmq::socket_t& socket, bool router, RejectStats& stats,
                                    std::string_view who);

// Waits up to `timeout_ms` for any of the sockets to be readable; returns the mask per socket.
int poll_sockets(zmq::pollitem_t* items, int n, int64_t timeout_ms);

}  // namespace moetrain::ps
