// The expert all-to-all: routed token rows travel from the rank that holds the token to the rank
// that owns the expert, and expert outputs travel back. As in DeepEP, the layout is computed
// first (per-rank, per-expert row counts, exchanged once per forward) and kept as a handle: the
// dispatch, the combine and both their backwards (a dispatch's backward is a combine and vice
// versa) reuse it.
//
// On the sending side rows are grouped by global expert (DispatchLayout order), and the experts
// of rank q are [q·El, (q+1)·El), so the rows for rank q are one contiguous run. They arrive
// source-major: rank 0's rows (by local expert), then rank 1's, ... Each source's block is itself
// grouped by expert, so the expert stage runs once per source block (recv_counts) and no row is
// ever regrouped: a flat dispatch or combine is exactly one MPI_Alltoallv.
//
// Two routes, identical results to the bit (they only move bytes, into the same places):
//   flat  one MPI_Alltoallv over the EP group;
//   2-D   for an EP group spread over nodes, packed by rank (node = q div L, local index
//         q mod L): first among the ranks of a node, each row to the local rank whose local index
//         is its destination's; then between ranks with the same local index, one message per
//         node pair carrying the rows of all L local sources. A row crosses the network once,
//         in (nodes − 1) large messages per rank instead of (P − L) small ones;
//   mixed for the adaptive route (parallel/adaptive_route.h): per (source node, destination node)
//         pair, either direct (one alltoallv over the group carries these rows, and every
//         node's own rows) or relayed through the 2-D stages. Every cross-node pair relayed is
//         the 2-D route; none is the flat one.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/buffer.h"
#include "core/comm.h"
#include "moe/exchange.h"

namespace moetrain {

struct A2aRoute {
  Comm* group = nullptr;  // the EP group
  Comm* intra = nullptr;  // 2-D: the ranks of this node (local index = rank there)
  Comm* inter = nullptr;  // 2-D: the ranks with this local index, one per node
  // 2-D only, optional: (nodes × nodes), entry [a·nodes + b] ≠ 0 when the rows from node a's
  // ranks to node b's go through the 2-D stages, 0 when they go direct (the diagonal is not
  // read). Null: every pair relayed (the 2-D route). Every rank must hold the same matrix.
  const std::vector<uint8_t>* relay = nullptr;
  bool two_d() const { return intra != nullptr; }
};

// The communicators of a 2-D route over `group`. ranks_per_node > 0 sets node = rank div
// ranks_per_node (emulating nodes on one machine); 0 finds the ranks sharing memory. Throws
// unless every node has the same number L of the group's ranks, packed by rank.
struct A2aHierarchy {
  std::unique_ptr<Comm> intra, inter;
  A2aRoute route(Comm& group) const { return {&group, intra.get(), inter.get()}; }
};
A2aHierarchy make_a2a_hierarchy(Comm& group, int ranks_per_node);

// The layout handle (moe/exchange.h), which the MoE layer reads to run its experts per source.
using A2aLayout = ExchangeLayout;

// The 2-D route's relay buffer (rows between the two stages), and the bf16 rows of a bf16
// exchange; grown as needed and reused.
struct A2aScratch {
  FloatBuffer relay;
  HalfBuffer send_lp, recv_lp;
};

// Collective over the route. counts (E): rows this rank routes to each global expert; E must be a
// multiple of the group size.
void a2a_plan(A2aLayout& plan, const A2aRoute& route, const int64_t* counts, int64_t E, int64_t C);

// Collective. out (R_recv, C) source-major = the rows of in (R_send, C) sent by every rank.
// wire = BF16 sends the rows rounded to bf16 (half the bytes) and widens them on arrival: out is
// then in rounded to bf16. Every rank of the group must pass the same wire type.
void a2a_dispatch(float* out, const float* in, const A2aLayout& plan, const A2aRoute& route,
                  A2aScratch& scratch, DType wire = DType::F32);
// Collective, the reverse. out (R_send, C) = the rows of in (R_recv, C, source-major) returned to
// the ranks and positions they were dispatched from.
void a2a_combine(float* out, const float* in, const A2aLayout& plan, const A2aRoute& route,
                 A2aScratch& scratch, DType wire = DType::F32);

}  // namespace moetrain
