// Process groups of a run: world = DP × EP. Rank r has EP index r mod EP and DP index r div EP, so
// the ranks of one expert-parallel group are neighbours (on one machine when ranks are packed by
// node). Global experts are sharded contiguously over an EP group (E/EP each); parameters other
// than experts are replicated on every rank; an expert is replicated over its expert-data-parallel
// (EDP) group, the DP ranks with the same EP index.
#pragma once
#include <cstdint>
#include <memory>

#include "core/comm.h"

namespace moetrain {

struct ParallelLayout {
  int world = 1, rank = 0;
  int ep = 1, dp = 1;              // EP group size, number of EP groups (= EDP group size)
  int ep_index = 0, dp_index = 0;  // this rank's place in its EP group and in its EDP group
};

// Throws unless 1 ≤ ep and ep divides world.
ParallelLayout make_parallel_layout(int world, int rank, int ep);

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
};

// Collective over `world`: every rank calls it with the same ep.
ProcessGroups make_process_groups(Comm& world, int ep);

}  // namespace moetrain
