// Process groups of a run: world = DP × EP. Rank r has EP index r mod EP and DP index r div EP, so
// the ranks of one expert-parallel group are neighbours (on one machine when ranks are packed by
// node). Global experts are sharded contiguously over an EP group (E/EP each); parameters other
// than experts are replicated on every rank; an expert is replicated over its expert-data-parallel
// (EDP) group, the DP ranks with the same EP index.
// Expert tensor parallelism (etp > 1, Megatron-Core's folding): world = EDP × EP × ETP, rank r =
// (e · ep + ep_index) · etp + etp_index; the etp neighbours of an ETP group share its experts'
// hidden units, an EP group is the ranks of one ETP position, and the expert gradients reduce
// over every rank holding the same experts (dp = world / ep of them: all their ETP shards, each
// rank writing its shard's gradients and zeros elsewhere).
#pragma once
#include <cstdint>
#include <memory>

#include "core/comm.h"

namespace moetrain {

struct ParallelLayout {
  int world = 1, rank = 0;
  int ep = 1, dp = 1;              // EP group size, number of EP groups (= EDP group size)
  int ep_index = 0, dp_index = 0;  // this rank's place in its EP group and in its EDP group
  int etp = 1, etp_index = 0;      // ETP group size and this rank's place in it
  // The world rank with EP index ep_index and (expert-replica) DP index dp_index.
  int rank_of(int ep_index, int dp_index) const {
    return ((dp_index / etp) * ep + ep_index) * etp + dp_index % etp;
  }
};

// Throws unless 1 ≤ ep, 1 ≤ etp and ep · etp divides world.
ParallelLayout make_parallel_layout(int world, int rank, int ep, int etp = 1);

// Experts [first, first + count) of E that EP index `ep_index` owns; throws unless ep divides E.
struct ExpertShard {
  int64_t first = 0, count = 0;
};
ExpertShard expert_shard(int64_t E, int ep, int ep_index);

// One communicator per traffic class, each on its own channel.
struct ProcessGroups {
  ParallelLayout layout;
  std::unique_ptr<Comm> control;       // world: losses, norms, router loads, checkpoints
  std::unique_ptr<Comm> moe_stats;     // world: balancing-loss statistics inside MoE forwards
  std::unique_ptr<Comm> grads;         // world: gradients of the replicated parameters
  std::unique_ptr<Comm> expert_grads;  // EDP group: expert gradients
  std::unique_ptr<Comm> a2a;           // EP group: the token all-to-all
  std::unique_ptr<Comm> etp;           // ETP group (null when etp = 1): the experts' row joins
};

// Collective over `world`: every rank calls it with the same ep and etp.
ProcessGroups make_process_groups(Comm& world, int ep, int etp = 1);

}  // namespace moetrain
