#include "ps/node.h"

#include <unistd.h>

#include <chrono>

#include "core/check.h"
#include "core/log.h"
#include "ps/security.h"

namespace moetrain::ps {

using Clock = std::chrono::steady_clock;

NodeLink::NodeLink(zmq::context_t& ctx, const std::string& scheduler, const std::string& role,
                   nlohmann::json extra, std::string standby)
    : scheduler_(scheduler),
      standby_(std::move(standby)),
      role_(role),
      ctx_(ctx),
      socket_(make_dealer(ctx, scheduler)) {
  nlohmann::json body = extra.is_object() ? extra : nlohmann::json::object();
  body["role"] = role;
  body["pid"] = static_cast<int64_t>(::getpid());
  const ClientHandshakes handshakes(ctx_, socket_);
  send(socket_, json_frame(Kind::Register, -1, body));
  // The scheduler answers at once; silence means a wrong address or a dead scheduler, and a
  // refused handshake another key pair (or plaintext against keys).
  const auto start = Clock::now();
  for (;;) {
    if (const std::string why = handshakes.refused(); !why.empty())
      MOETRAIN_FAIL("the scheduler at {} refused the handshake ({}): {}", scheduler, why,
                    curve_enabled() ? "is --keys this job's key pair, and does the scheduler "
                                      "run with keys (not --insecure)?"
                                    : "it runs with a job key pair: give this node --keys DIR "
                                      "with the same pair instead of --insecure");
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    poll_sockets(&item, 1, 100);
    if (auto in = try_receive(socket_, false, rejects_, "ps " + role)) {
      if (in->header.kind_enum() == Kind::Shutdown)
        MOETRAIN_FAIL("the scheduler at {} refused this {}: {}", scheduler, role,
                      in->json().value("reason", ""));
      if (in->header.kind_enum() != Kind::HeartbeatAck) continue;
      nlohmann::json j = in->json();
      node_id_ = j.at("node_id").get<int32_t>();
      index_ = j.at("index").get<int64_t>();
      timeout_ = j.at("heartbeat_timeout").get<double>();
      thread_ = std::thread(&NodeLink::heartbeat_loop, this, scheduler,
                            j.at("heartbeat_interval").get<double>());
      return;
    }
    MOETRAIN_CHECK(std::chrono::duration<double>(Clock::now() - start).count() < 30,
                   "no answer from the scheduler at {} within 30 s: is it running there{}?",
                   scheduler,
                   curve_enabled() ? ", and is --keys this job's key pair (a wrong key is "
                                     "refused at the handshake without an answer)"
                                   : ", and does it run --insecure too (a keyed scheduler "
                                     "refuses plaintext peers at the handshake)");
  }
}

NodeLink::~NodeLink() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void NodeLink::check() {
  if (lost_ && !standby_.empty() && !rejoined_) rejoin();
  MOETRAIN_CHECK(!dead_,
                 "the scheduler declared this node dead (missed heartbeats); restart it "
                 "to rejoin the job");
  MOETRAIN_CHECK(!lost_,
                 "the scheduler at {} has not answered for {:.1f} s: it is gone, and with it the "
                 "job's membership (it holds only metadata; parameters and checkpoints are on "
                 "the servers and in the run directory); the job ends",
                 scheduler_, timeout_);
}

// The scheduler went silent: register with the standby as the node this is (id, index, role's
// state); the standby rebuilds the job's membership and assignment from these.
void NodeLink::rejoin() {
  rejoined_ = true;
  log_warn("ps {} (node {}): the scheduler at {} is silent; moving to the standby at {}", role_,
           node_id_, scheduler_, standby_);
  socket_ = make_dealer(ctx_, standby_);
  nlohmann::json body = rejoin_state_ ? rejoin_state_() : nlohmann::json::object();
  body["role"] = role_;
  body["pid"] = static_cast<int64_t>(::getpid());
  body["rejoin"] = true;
  body["node_id"] = node_id_;
  body["index"] = index_;
  send(socket_, json_frame(Kind::Register, node_id_, body));
  const auto start = Clock::now();
  for (;;) {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    poll_sockets(&item, 1, 100);
    if (auto in = try_receive(socket_, false, rejects_, "ps " + role_)) {
      if (in->header.kind_enum() == Kind::Shutdown)
        MOETRAIN_FAIL("the standby scheduler at {} refused this {}: {}", standby_, role_,
                      in->json().value("reason", ""));
      if (in->header.kind_enum() != Kind::HeartbeatAck) continue;
      scheduler_ = standby_;
      lost_ = false;
      return;
    }
    MOETRAIN_CHECK(std::chrono::duration<double>(Clock::now() - start).count() < 30,
                   "the scheduler is gone and the standby at {} did not answer within 30 s",
                   standby_);
  }
}

void NodeLink::heartbeat_loop(std::string scheduler, double interval) {
  zmq::socket_t s = make_dealer(ctx_, scheduler);
  RejectStats rejects;
  auto last_ack = Clock::now();
  auto next = Clock::now();
  while (!stop_) {
    if (Clock::now() >= next) {
      Header h;
      h.kind = static_cast<uint16_t>(Kind::Heartbeat);
      h.sender = node_id_;
      h.value = throughput_.load();
      send(s, encode(h, {}));
      next = Clock::now() +
             std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(interval));
    }
    zmq::pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
    poll_sockets(&item, 1, 20);
    while (auto in = try_receive(s, false, rejects, "ps heartbeat")) {
      if (in->header.kind_enum() == Kind::HeartbeatAck) last_ack = Clock::now();
      if (in->header.kind_enum() == Kind::Shutdown) dead_ = true;
    }
    if (std::chrono::duration<double>(Clock::now() - last_ack).count() > timeout_) {
      lost_ = true;
      if (!standby_.empty() && !moved_) {
        // Heartbeats go to the standby from now on; it answers once this node registered there.
        moved_ = true;
        s = make_dealer(ctx_, standby_);
        last_ack = Clock::now();
      }
    }
  }
}

std::optional<Incoming> NodeLink::next_control(int64_t timeout_ms, bool* ok_shutdown) {
  const auto start = Clock::now();
  for (;;) {
    check();
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    poll_sockets(&item, 1, std::min<int64_t>(timeout_ms, 50));
    if (auto in = try_receive(socket_, false, rejects_, "ps node")) {
      if (in->header.kind_enum() == Kind::Shutdown) {
        nlohmann::json j = in->json();
        MOETRAIN_CHECK(j.value("ok", false), "the scheduler stopped the job: {}",
                       j.value("reason", std::string("no reason given")));
        if (ok_shutdown) *ok_shutdown = true;
        return std::nullopt;
      }
      return in;
    }
    if (std::chrono::duration<double>(Clock::now() - start).count() * 1000 >=
        static_cast<double>(timeout_ms))
      return std::nullopt;
  }
}

}  // namespace moetrain::ps
