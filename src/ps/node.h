// What servers and workers share: registration with the scheduler, and a heartbeat thread on
// its own socket that also notices when the scheduler stops answering.
#pragma once
#include <zmq.hpp>

#include <atomic>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "ps/transport.h"

namespace moetrain::ps {

class NodeLink {
 public:
  // Registers (role "server" or "worker", plus `extra` fields) and starts heartbeating.
  NodeLink(zmq::context_t& ctx, const std::string& scheduler, const std::string& role,
           nlohmann::json extra = {});
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
  // Throws (a clear message) once the scheduler is unreachable for the heartbeat timeout, or
  // declared this node dead.
  void check() const;

  // Waits for the next control message (Setup, Finish, Shutdown), calling check() meanwhile.
  // A Shutdown throws unless it says ok; then `ok_shutdown` is set and nullopt returned.
  std::optional<Incoming> next_control(int64_t timeout_ms, bool* ok_shutdown);

 private:
  void heartbeat_loop(std::string scheduler, double interval);

  std::string scheduler_;
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
