// The client side of the key-value store, over ZeroMQ (ps-lite's KVWorker): push and pull of
// key ranges, each returning a ticket; wait(ticket) blocks until every server answered.
#pragma once
#include <zmq.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ps/codec.h"
#include "ps/transport.h"

namespace moetrain::ps {

struct ServerInfo {
  int64_t index = 0;
  std::string endpoint;        // empty: the server is down (waits for it block until it is back)
  int64_t begin = 0, end = 0;  // key range
};

// What a worker tells the server about a push.
struct PushMeta {
  int64_t rows = 0;         // rows of the global batch behind this gradient
  int64_t global_rows = 0;  // rows of the global batch
  double loss = 0;          // mean loss over those rows
};

// The client side of the key-value store (as ps-lite's KVWorker): push and pull return a ticket
// at once, the messages go out in the background (ZeroMQ's I/O thread); wait(ticket) blocks until
// every server has answered it. Replies for other tickets that arrive meanwhile are kept.
//
// Outgoing frames are built in place in ZeroMQ messages and kept (shared, not copied) until
// their server answered, so that when a server's backup takes over (update_servers) what the
// dead primary had not answered goes again to the new endpoint, and so does the latest push
// (the dead primary may have acknowledged it without applying it).
// What wait() found.
struct WaitResult {
  // The servers rolled back to a checkpoint while waiting (reset() ran from on_idle): the
  // request was forgotten and `clock` means nothing; the caller pulls and goes on from there.
  bool rolled_back = false;
  int64_t clock = 0;  // pull: the clock to continue at; push: the servers' version
};

class KvWorker {
 public:
  // `on_idle` runs while wait() blocks (control messages from the scheduler: it may re-route
  // with update_servers() or roll back with reset(); it throws only to stop the job).
  KvWorker(zmq::context_t& ctx, int32_t worker_index, std::vector<ServerInfo> servers,
           uint32_t generation, std::function<void()> on_idle);

  // New endpoints (a backup promoted, a server down or back): requests that a re-routed server
  // has not answered are sent again to its new endpoint. Key ranges never change.
  void update_servers(const std::vector<ServerInfo>& servers);
  // A roll-back to a server checkpoint: every outstanding request is forgotten (its replies are
  // ignored) and later ones carry `generation`.
  void reset(const std::vector<ServerInfo>& servers, uint32_t generation);
  uint32_t generation() const { return generation_; }
  // This worker is one of a group of P processes (ps/worker.h): its pushes say so, so that the
  // servers outside sync apply the group's pushes of a clock as one update.
  void set_group_size(int64_t p) { group_size_ = p; }

  // Pushes grads (the whole flat vector, P floats) at `clock`. `skip` lists global ranges left
  // out (sorted, disjoint: experts that received no tokens); `residual` (P floats) enables int8
  // error feedback.
  int64_t push(int64_t clock, const float* grads, const std::vector<Span>& skip, Encoding enc,
               const PushMeta& meta, float* residual);
  // Pulls every server's range into params (P floats) once the consistency mode allows clock
  // `clock`; clock < 0 reads now (joining, final read). The servers send the values in `enc`
  // (they keep f32): params are then the decoded values. `keys` (global ranges, sorted,
  // disjoint; null: every key) asks for those keys only, leaving the rest of params as it is: a
  // worker group's rank reads its own share (every server still answers, with the clock).
  int64_t pull(int64_t clock, float* params, Encoding enc = Encoding::F32,
               const std::vector<Span>* keys = nullptr);
  // Blocks until every server answered; for a pull returns the clock to continue at (the least
  // any server reported), for a push the servers' version. Returns rolled_back, at once, for a
  // ticket that a roll-back (reset()) forgot, before or during the wait.
  WaitResult wait(int64_t ticket);

  int64_t push_bytes() const { return push_bytes_; }
  int64_t dense_push_bytes() const { return dense_push_bytes_; }
  int64_t pull_bytes() const { return pull_bytes_; }
  int64_t dense_pull_bytes() const { return dense_pull_bytes_; }  // the same replies as f32
  double wait_seconds() const { return wait_s_; }
  const std::vector<ServerInfo>& servers() const { return servers_; }

 private:
  struct Pending {
    float* params = nullptr;  // pulls: where replies go
    Encoding enc = Encoding::F32;  // pulls: the encoding asked for
    int64_t answered = 0;
    int64_t clock = INT64_MAX;
    std::vector<char> done;              // per server: answered
    std::vector<zmq::message_t> frames;  // per server: the request, until answered
  };
  void receive_all();
  void connect(std::size_t s);
  void send_request(Pending& p, std::size_t s, zmq::message_t&& frame);

  zmq::context_t& ctx_;
  int32_t index_;
  int64_t group_size_ = 1;
  uint32_t generation_ = 0;
  std::vector<ServerInfo> servers_;
  std::vector<std::unique_ptr<zmq::socket_t>> sockets_;  // null while a server is down
  // Per server, the latest push: an acknowledgement means received, not applied and replicated,
  // so it goes again to a promoted backup.
  std::vector<zmq::message_t> last_push_;
  std::function<void()> on_idle_;
  RejectStats rejects_;
  std::map<int64_t, Pending> pending_;
  int64_t next_ticket_ = 1;
  int64_t first_live_ticket_ = 1;  // tickets below were forgotten by a roll-back
  int64_t push_bytes_ = 0, dense_push_bytes_ = 0, pull_bytes_ = 0, dense_pull_bytes_ = 0;
  double wait_s_ = 0;
};

}  // namespace moetrain::ps
