#include "ps/node.h"

#include <unistd.h>

#include <chrono>
#include <thread>

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
  if (lost_ && !rejoined_) {
    bool succession = false;
    {
      const std::lock_guard<std::mutex> g(mu_);
      succession = !successors_.empty();
    }
    if (!standby_.empty() || succession) rejoin();
  }
  MOETRAIN_CHECK(!dead_,
                 "the scheduler declared this node dead (missed heartbeats); restart it "
                 "to rejoin the job");
  MOETRAIN_CHECK(!lost_,
                 "the scheduler at {} has not answered for {:.1f} s: it is gone, and with it the "
                 "job's membership (it holds only metadata; parameters and checkpoints are on "
                 "the servers and in the run directory); the job ends",
                 scheduler_, timeout_);
}

// The scheduler went silent: register with the standby, or else with the first server of the
// succession order that answers, as the node this is (id, index, role's state); that scheduler
// rebuilds the job's membership and assignment from these.
void NodeLink::rejoin() {
  rejoined_ = true;
  if (!standby_.empty()) {
    log_warn("ps {} (node {}): the scheduler at {} is silent; moving to the standby at {}", role_,
             node_id_, scheduler_, standby_);
    MOETRAIN_CHECK(register_again(standby_, 30),
                   "the scheduler is gone and the standby at {} did not answer within 30 s",
                   standby_);
    return;
  }
  std::vector<Successor> order;
  {
    const std::lock_guard<std::mutex> g(mu_);
    order = successors_;
  }
  const std::string dead = scheduler_;
  const double wait = 2 * timeout_;
  nlohmann::json passed = nlohmann::json::array();
  for (const Successor& s : order) {
    const std::string name =
        fmt::format("server {}{} (node {})", s.index, s.primary ? "" : " (backup)", s.node);
    if (s.node == node_id_) {
      const std::string cause = fmt::format(
          "the scheduler at {} did not answer for {:.1f} s and the job has no standby; {} is the "
          "first live server in the succession order (server index, primary before backup){}",
          dead, timeout_, name,
          passed.empty() ? std::string()
                         : fmt::format(": {} server(s) before it did not answer within {:.1f} s",
                                       passed.size(), wait));
      const nlohmann::json why = {{"cause", cause},
                                  {"server", s.index},
                                  {"node", s.node},
                                  {"primary", s.primary},
                                  {"dead_scheduler", dead},
                                  {"passed_over", passed}};
      if (!elect_ || !elect_(why)) continue;
      log_warn("ps {} (node {}): elected: {}; running the scheduler at {}", role_, node_id_, cause,
               s.endpoint);
      MOETRAIN_CHECK(register_again(s.endpoint, 30),
                     "this server took the scheduler's role at {} but it did not answer within "
                     "30 s",
                     s.endpoint);
      return;
    }
    log_warn("ps {} (node {}): the scheduler at {} is silent and there is no standby; "
             "registering with {} at {}, next in the succession order",
             role_, node_id_, dead, name, s.endpoint);
    if (register_again(s.endpoint, wait)) return;
    log_warn("ps {} (node {}): {} did not answer within {:.1f} s; passed over", role_, node_id_,
             name, wait);
    passed.push_back({{"server", s.index}, {"node", s.node}, {"endpoint", s.endpoint}});
  }
  MOETRAIN_FAIL(
      "the scheduler at {} has not answered for {:.1f} s and none of the {} server(s) of the "
      "succession order answered as its successor; the job ends",
      dead, timeout_, order.size());
}

bool NodeLink::register_again(const std::string& endpoint, double wait_s) {
  socket_ = make_dealer(ctx_, endpoint);
  nlohmann::json body = rejoin_state_ ? rejoin_state_() : nlohmann::json::object();
  body["role"] = role_;
  body["pid"] = static_cast<int64_t>(::getpid());
  body["rejoin"] = true;
  body["node_id"] = node_id_;
  body["index"] = index_;
  send(socket_, json_frame(Kind::Register, node_id_, body));
  const auto start = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - start).count() < wait_s) {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    poll_sockets(&item, 1, 100);
    if (auto in = try_receive(socket_, false, rejects_, "ps " + role_)) {
      if (in->header.kind_enum() == Kind::Shutdown)
        MOETRAIN_FAIL("the scheduler at {} refused this {}: {}", endpoint, role_,
                      in->json().value("reason", ""));
      if (in->header.kind_enum() != Kind::HeartbeatAck) continue;
      scheduler_ = endpoint;
      {
        // Heartbeats go there from now on.
        const std::lock_guard<std::mutex> g(mu_);
        retarget_ = endpoint;
      }
      lost_ = false;
      return true;
    }
  }
  return false;
}

void NodeLink::heartbeat_loop(std::string scheduler, double interval) {
  zmq::socket_t s = make_dealer(ctx_, scheduler);
  RejectStats rejects;
  auto last_ack = Clock::now();
  auto next = Clock::now();
  // The scheduler went silent: wait until rejoin() found the one that answers.
  bool waiting = false;
  while (!stop_) {
    if (waiting) {
      std::string to;
      {
        const std::lock_guard<std::mutex> g(mu_);
        to.swap(retarget_);
      }
      if (to.empty()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      s = make_dealer(ctx_, to);
      waiting = false;
      last_ack = next = Clock::now();
    }
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
      if (in->header.kind_enum() == Kind::Shutdown) dead_ = true;
      if (in->header.kind_enum() != Kind::HeartbeatAck) continue;
      last_ack = Clock::now();
      try {
        const nlohmann::json j = in->json();
        if (j.contains("successors")) {
          std::vector<Successor> order = successors_from_json(j.at("successors"));
          const std::lock_guard<std::mutex> g(mu_);
          successors_ = std::move(order);
        }
      } catch (const std::exception& e) {
        log_warn("ps heartbeat: ignored a malformed acknowledgement: {}", e.what());
      }
    }
    if (std::chrono::duration<double>(Clock::now() - last_ack).count() > timeout_) {
      lost_ = true;
      waiting = true;
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
