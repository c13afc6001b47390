// The other half of hot-expert replication (moe/placement.h): a replica computes with its logical
// expert's weights and its gradient belongs to that expert. Every rank keeps the full parameter
// buffer but updates only the experts it owns statically (expert e on EP rank e / El), so both
// directions are messages between the owner and the ranks holding its replicas, over the EP group:
//   refresh      owner → holder: the expert's w1, w3, w2 overwrite the holder's stale copy
//   reduce_grads holder → owner: the owner adds the replicas' gradients to its own, in rank order,
//                and the holder's copy is zeroed (only the owner's counts, e.g. in the gradient
//                norm)
// Bytes per replica off its owner: 3·F·C floats each way. A placement without such replicas (the
// static one) sends nothing.
#pragma once
#include <cstdint>
#include <vector>

#include "core/comm.h"
#include "moe/config.h"
#include "moe/placement.h"

namespace moetrain {

class ReplicaSync {
 public:
  // group: the EP group (its size = the placements' P, this process at its rank); must outlive
  // the sync.
  ReplicaSync(Comm& group, const MoeConfig& cfg);

  // Collective over the group: every replica of p gets its expert's weights from the owner.
  void refresh(const Placement& p, const MoeWeights& w);
  // Collective: the replicas' gradients summed into their owners' g, the senders' zeroed.
  void reduce_grads(const Placement& p, const MoeWeights& g);

 private:
  struct Copy {
    int64_t expert = 0, owner = 0, holder = 0;
  };
  std::vector<Copy> copies(const Placement& p) const;  // replicas off their owner, slot order
  // Moves one block of 3·F·C floats per copy from `from` to `to` (owner or holder side); the
  // receiver gets them packed, by source rank then slot order.
  void move(const std::vector<Copy>& copies, bool to_owner, const MoeWeights& w,
            std::vector<float>& received);

  Comm& group_;
  MoeConfig cfg_;
  std::vector<float> send_;
};

}  // namespace moetrain
