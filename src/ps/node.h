// What servers and workers share: registration with the scheduler, and a heartbeat thread on
// its own socket that also notices when the scheduler stops answering.
#pragma once
#include <zmq.hpp>

#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "ps/election.h"
#include "ps/transport.h"

namespace moetrain::ps {

class NodeLink {
 public:
  // Registers (role "server" or "worker", plus `extra` fields) and starts heartbeating. With a
  // `standby` scheduler, a scheduler that stops answering is replaced by it: the node registers
  // there again with what `rejoin_state` says (its id, index and role's state) and goes on.
  // Without one, the node registers again the same way with the first server of the succession
  // order that answers (ps/election.h); a server at its own entry is elected (`set_elect`).
  NodeLink(zmq::context_t& ctx, const std::string& scheduler, const std::string& role,
           nlohmann::json extra = {}, std::string standby = "");
  ~NodeLink();
  NodeLink(const NodeLink&) = delete;
  NodeLink& operator=(const NodeLink&) = delete;

  int32_t node_id() const { return node_id_; }
  int64_t index() const { return index_; }
  zmq::socket_t& socket() { return socket_; }  // control messages from the scheduler arrive here
  RejectStats& rejects() { return rejects_; }
  const std::string& scheduler() const { return scheduler_; }
  double heartbeat_timeout() const { return timeout_; }

  // Worker throughput (rows/s) for the capability assignment, sent with every heartbeat.
  void set_throughput(double rows_per_s) { throughput_.store(rows_per_s); }
  // What this node tells a standby scheduler that takes over (merged into its Register).
  void set_rejoin_state(std::function<nlohmann::json()> f) { rejoin_state_ = std::move(f); }
  // A server: takes the scheduler's role when the succession order comes to it, given why
  // (ps/election.h); returns false when it cannot (no setup yet), and the next one is tried.
  void set_elect(std::function<bool(const nlohmann::json&)> f) { elect_ = std::move(f); }
  // Throws (a clear message) once the scheduler is unreachable for the heartbeat timeout (and
  // there is no standby, or the standby does not answer either), or declared this node dead.
  // Moves to the standby when the scheduler went silent.
  void check();

  // Waits for the next control message (Setup, Finish, Shutdown), calling check() meanwhile.
  // A Shutdown throws unless it says ok; then `ok_shutdown` is set and nullopt returned.
  std::optional<Incoming> next_control(int64_t timeout_ms, bool* ok_shutdown);

 private:
  void heartbeat_loop(std::string scheduler, double interval);
  void rejoin();
  // Registers again at `endpoint` as this node; false when it did not answer within `wait_s`.
  bool register_again(const std::string& endpoint, double wait_s);

  std::string scheduler_, standby_, role_;
  std::function<nlohmann::json()> rejoin_state_;
  std::function<bool(const nlohmann::json&)> elect_;
  // Written by the heartbeat thread (the order from the acknowledgements) and by rejoin() (where
  // heartbeats go from now on).
  std::mutex mu_;
  std::vector<Successor> successors_;
  std::string retarget_;
  bool rejoined_ = false;
  zmq::context_t& ctx_;
  zmq::socket_t socket_;
  RejectStats rejects_;
  int32_t node_id_ = -1;
  int64_t index_ = -1;
  double timeout_ = 5;
  std::atomic<double> throughput_{0};
  std::atomic<bool> stop_{false}, lost_{false}, dead_{false};
  std::thread thread_;
};

}  // namespace moetrain::ps
