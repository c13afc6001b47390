// Hot-expert replication at run time: the exchange sees expert slots (moe/placement.h) instead of
// logical experts. After routing, each assignment to logical expert e goes to one of e's replica
// slots, split deterministically: e's n assignments, in token order (then routing position), are
// cut into contiguous runs, replica i of k (slots ascending) taking [n·i/k, n·(i+1)/k). The split
// depends only on this process's routing, so every process that sees the same data makes it.
#pragma once
#include <cstdint>
#include <vector>

#include "moe/placement.h"
#include "moe/router.h"

namespace moetrain {

// out = r with every logical expert (in expert and selected) replaced by a slot of p; out.E =
// p.slots(). A dropped assignment's selected names the expert's first slot.
void route_to_slots(Routing& out, const Routing& r, const Placement& p);

// (E) the logical experts' counts from per-slot counts (p.slots()).
void slot_counts_to_experts(int64_t* per_expert, const int64_t* per_slot, const Placement& p);

}  // namespace moetrain
