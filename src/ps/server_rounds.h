// A primary server's side of the scheduler's rounds of a sync update's global figures
// (ps/global_norm.h: expert reweighting's sums, then the clip, over the range's FlatGradient):
// the wait for the scheduler's sums on the control socket, which keeps aside the control
// messages that come meanwhile.
#pragma once
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ps/global_norm.h"
#include "ps/node.h"
#include "ps/transport.h"

namespace moetrain::ps {

// Thrown out of an update that waits for a round when the scheduler rolls the job back (or
// stops it) instead: the clock stays pending in the store, and the control message that
// interrupted it is handled next.
struct UpdateAbandoned {};

class ServerRounds {
 public:
  explicit ServerRounds(NodeLink& link) : link_(link) {}
  void set_name(std::string who) { who_ = std::move(who); }

  // Sends this range's part of round `kind` of update `version` to the scheduler and waits for
  // the reply: {sum} (the parts summed in server order), and for a clip round {norm, scale}.
  // Control messages that come meanwhile are kept for next_deferred(), except that a roll-back
  // (a Restore, or the checkpoint query that precedes it) or a Shutdown abandons the update
  // (UpdateAbandoned): the clock it undoes will not be decided. The report is sent again every
  // heartbeat timeout, so a scheduler that took over collects it too; a server that never reports
  // makes the scheduler stop the job, naming it.
  nlohmann::json agree(int64_t version, int64_t clock, uint32_t generation, RoundKind kind,
                       const std::vector<double>& part);
  // The reply's sums alone.
  std::vector<double> sums(int64_t version, int64_t clock, uint32_t generation, RoundKind kind,
                           const std::vector<double>& part);

  // The control messages that came while an update waited, oldest first.
  std::optional<Incoming> next_deferred();
  bool has_deferred() const { return !deferred_.empty(); }

 private:
  NodeLink& link_;
  std::string who_ = "ps server";
  std::deque<Incoming> deferred_;
};

}  // namespace moetrain::ps
