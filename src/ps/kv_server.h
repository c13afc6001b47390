// The server side of the key-value store (as ps-lite's KVServer): one key range of the flat
// parameter vector, served over ZeroMQ. It answers pushes (acknowledged at once, summed into
// updates as the consistency rules decide: consistency.h), pulls (answered once the rules allow
// the asked clock, and once a backup holds every update the reply shows) and, on a backup, its
// primary's replicated updates. What an update does to the values is not its business: the
// update rule is a handler plugged in from outside (the training server's optimizer step), except
// in average mode, where the pushes carry weighted parameters and the values become their sum.
//
// Replication (`--server-replicas 2`): after each update the exact input of the update rule
// (the summed gradient, the learning rate and the rule's side input) goes to the backup, which replays it through its
// own handler; a pull is answered only once the backup confirmed every update in the reply, so
// nothing a worker has seen can be lost when the primary dies and the backup is promoted. A
// backup attached later (a promoted primary's new one) first receives a snapshot of the whole
// state (values, the update rule's state, the worker clocks) on the same socket, so the updates
// that follow apply to exactly the primary's state; pulls wait until it confirmed the snapshot.
#pragma once
#include <zmq.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ps/codec.h"
#include "ps/consistency.h"
#include "ps/transport.h"

namespace moetrain::ps {

// One update about to apply.
struct UpdateInput {
  int64_t version = 0;        // updates applied before this one
  int64_t clock = 0;          // the clock its pushes were computed at
  int64_t schedule_step = 0;  // the lr schedule's step
  float* sum = nullptr;       // (key range) the summed gradient, rescaled to the global batch
  int64_t n = 0;
};

// One update applied (after the version advanced).
struct UpdateApplied {
  int64_t version = 0;  // updates applied, this one included
  int64_t clock = 0;
  double lr = 0;
  int64_t pushes = 0, rows = 0;
  double loss = 0;      // mean over the rows
  int64_t worker = -1;  // async / ssp: the pushing worker
};

// The update rule's own state over the key range (optimizer buffers and step count), for a
// snapshot to a new backup.
struct RuleState {
  std::vector<std::vector<float>> buffers;  // each (key range)
  int64_t steps = 0;
  std::string extra;  // the rule's state beyond them (the importance reweighting's averages)
};

struct KvServerHandlers {
  // The update rule: steps the values with input.sum; returns the learning rate it used. May
  // throw (a non-finite gradient): the update is not applied.
  std::function<double(const UpdateInput&, float* values)> update;
  // The update rule's input beside the sum and the learning rate, asked right after each update
  // a primary applied, for its backup (the sparse-expert mask the step went around). May be
  // empty (nothing).
  std::function<std::string()> side_input;
  // A backup replays its primary's update: the same rule's step with exactly this input.
  std::function<void(float* sum, double lr, std::string_view side, float* values)> replay;
  // The update rule's state, saved on a primary and loaded on a new backup.
  std::function<RuleState()> save_state;
  std::function<void(const RuleState&)> load_state;
  // After an update applied on a primary (checkpoints, metrics).
  std::function<void(const UpdateApplied&)> applied;
  // The ranges a push carried (relative to the key range), for counting expert contributors.
  std::function<void(const std::vector<Span>&)> push_ranges;
};

struct KvServerStats {
  int64_t pushes = 0, late_dropped = 0, stale_dropped = 0, refused = 0;
  int64_t push_bytes = 0, dense_push_bytes = 0, replicated_in = 0;
  int64_t pulls = 0, pull_bytes = 0, dense_pull_bytes = 0;  // replies: frames, and as f32
  int64_t snapshots_in = 0, snapshots_out = 0;
  std::map<int64_t, int64_t> blocked_pulls;  // worker → pulls that had to wait
};

class KvServer {
 public:
  // Binds the ROUTER workers reach (endpoint()); serves nothing until start().
  KvServer(zmq::context_t& ctx, const std::string& bind);

  const std::string& endpoint() const { return endpoint_; }
  // The key range and its initial values; the rules; the handlers. `who` names it in logs.
  void start(int64_t index, int64_t begin, int64_t end, std::vector<float> values,
             const ConsistencyConfig& rules, KvServerHandlers handlers);
  bool started() const { return started_; }

  // The workers that count now; updates that become complete apply, pulls that may be answered
  // are.
  void set_active(const std::vector<int64_t>& workers);
  // The backup's endpoint ("" for none). A new backup is sent this server's state first.
  // Returns whether it changed.
  bool set_backup(const std::string& endpoint);
  bool has_backup() const { return backup_ != nullptr; }

  // Back to a checkpoint: these values at `clock`, with these worker clocks; what was pending
  // belongs to the clocks being undone, and messages of an older generation are dropped.
  void restore(int64_t clock, uint32_t generation, std::vector<float> values,
               std::map<int64_t, int64_t> worker_clocks);

  // Waits up to timeout_ms for a message on the server's sockets or on `also` (the control
  // socket, handled by the caller), then serves what came on the server's.
  void poll(zmq::socket_t& also, int64_t timeout_ms);

  int64_t version() const { return rules_.version(); }
  uint32_t generation() const { return generation_; }  // of the latest roll-back
  const ConsistencyRules& rules() const { return rules_; }
  const std::vector<float>& values() const { return values_; }
  const KvServerStats& stats() const { return stats_; }
  const RejectStats& rejects() const { return rejects_; }
  void set_name(std::string who) { who_ = std::move(who); }

 private:
  struct Push {
    zmq::message_t frame;          // a dense f32 push: the gradient is read where it arrived
    std::vector<float> owned;      // other encodings: decoded here
    const float* grads = nullptr;  // (key range)
    int64_t rows = 0, global_rows = 0;
    double loss = 0;
  };
  struct PendingPull {
    std::string identity;
    Header h;
    std::vector<Span> ranges;  // a sparse pull: the ranges it asks for (relative to the range)
  };

  void on_data(Incoming& in);
  void on_push(Incoming& in);
  void on_replicate(const Incoming& in);
  void on_snapshot(const Incoming& in);
  void send_snapshot();
  void apply_ready();
  void apply(const Update& u);
  void replicate(int64_t version, double lr, int64_t worker, int64_t worker_clock,
                 int64_t group_size);
  bool ready(const Header& pull) const;
  void serve_pulls();
  std::string ack(const Header& req) const;

  zmq::context_t& ctx_;
  zmq::socket_t router_;
  std::unique_ptr<zmq::socket_t> backup_;
  std::string endpoint_, backup_endpoint_, who_ = "ps server";
  bool started_ = false;
  int64_t index_ = -1, begin_ = 0, end_ = 0;
  uint32_t generation_ = 0;
  int64_t replicated_ = 0;           // the backup holds every update before this version
  std::vector<float> values_, sum_;  // (key range) each
  ConsistencyRules rules_;
  KvServerHandlers handlers_;
  std::map<int64_t, Push> pushes_;  // push id → gradient, while the rules hold it
  int64_t next_push_id_ = 0;
  std::vector<PendingPull> pulls_;
  KvServerStats stats_;
  RejectStats rejects_;
};

}  // namespace moetrain::ps
