#include "parallel/alltoall.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "core/check.h"

namespace moetrain {

A2aHierarchy make_a2a_hierarchy(Comm& group, int ranks_per_node) {
  MOETRAIN_CHECK(ranks_per_node >= 0, "ranks per node {} must be >= 0 (0 = detect)",
                 ranks_per_node);
  const int P = group.size(), q = group.rank();
  std::unique_ptr<Comm> node;
  if (ranks_per_node > 0) {
    MOETRAIN_CHECK(P % ranks_per_node == 0,
                   "--ranks-per-node {} must divide the {} ranks of the expert-parallel group",
                   ranks_per_node, P);
    node = group.split(q / ranks_per_node, q, {"a2a_intra"});
  } else {
    node = group.split_shared({"a2a_intra"});
  }
  const int L = node->size();
  // Packed by rank: every node holds L consecutive ranks, in order.
  int64_t ok = (P % L == 0 && node->rank() == q % L) ? 1 : 0;
  const std::vector<int64_t> all_ok = group.allgather_one(ok);
  const std::vector<int64_t> sizes = group.allgather_one(L);
  for (int r = 0; r < P; ++r) {
    MOETRAIN_CHECK(all_ok[r] == 1 && sizes[r] == L,
                   "the 2-D all-to-all needs the same number of ranks on every node, packed by "
                   "rank (rank r on node "
                   "r div L); rank {} has {} ranks on its node, rank {} has {} (use "
                   "--ranks-per-node or place ranks "
                   "by node, e.g. mpirun --map-by node:PE=1 --rank-by slot)",
                   q, L, r, sizes[r]);
  }
  A2aHierarchy h;
  h.intra = std::move(node);
  h.inter = group.split(q % L, q / L, {"a2a_inter"});
  return h;
}

void a2a_plan(A2aLayout& plan, const A2aRoute& route, const int64_t* counts, int64_t E, int64_t C) {
  Comm& comm = *route.group;
  const int P = comm.size();
  MOETRAIN_CHECK(E >= 1 && E % P == 0,
                 "a2a_plan: {} experts cannot be split evenly over an EP group of {} ranks", E, P);
  MOETRAIN_CHECK(C >= 1, "a2a_plan: row width C = {} must be positive", C);
  const int64_t El = E / P;
  plan.P = P, plan.E_local = El, plan.C = C;
  plan.send_rows.assign(P, 0);
  plan.recv_rows.assign(P, 0);
  plan.recv_counts.assign(P * El, 0);
  plan.expert_counts.assign(El, 0);
  plan.R_send = 0;
  for (int64_t e = 0; e < E; ++e) {
    MOETRAIN_CHECK(counts[e] >= 0, "a2a_plan: expert {} has {} rows", e, counts[e]);
    plan.send_rows[e / El] += counts[e];
    plan.R_send += counts[e];
  }
  // Counts for rank q's experts go to rank q: El int64 per pair.
  std::vector<int64_t> bytes(P, El * static_cast<int64_t>(sizeof(int64_t))), displs(P);
  for (int q = 0; q < P; ++q) displs[q] = q * bytes[q];
  comm.alltoallv(plan.recv_counts.data(), bytes, displs, counts, bytes, displs);

  plan.recv_offset.assign(P + 1, 0);
  for (int q = 0; q < P; ++q) {
    for (int64_t j = 0; j < El; ++j) {
      plan.recv_rows[q] += plan.recv_counts[q * El + j];
      plan.expert_counts[j] += plan.recv_counts[q * El + j];
    }
    plan.recv_offset[q + 1] = plan.recv_offset[q] + plan.recv_rows[q];
  }
  plan.R_recv = plan.recv_offset[P];
  plan.rows.clear();
  if (route.two_d()) {
    MOETRAIN_CHECK(route.intra->size() * route.inter->size() == P,
                   "a2a_plan: a 2-D route of {} x {} ranks over an EP group of {}",
                   route.intra->size(), route.inter->size(), P);
    // Relaying ranks need to know what passes through them: every rank's row counts.
    plan.rows.resize(static_cast<std::size_t>(P) * P);
    comm.allgather(plan.rows.data(), plan.send_rows.data(), std::vector<int64_t>(P, P));
  }
}

namespace {

// Which node pairs an exchange relays through the 2-D stages, in the dispatch's terms: via(a, b)
// for the rows node a's ranks route to node b's experts. A combine moves those rows from b to a,
// so it relays them where the route relays traffic from b to a. A node's own rows take the
// stages only when every cross-node pair does (then this is the 2-D route exactly).
struct Paths {
  int nodes;
  const std::vector<uint8_t>* relay;  // null: every pair
  bool reverse;
  bool all_cross = true;  // every cross-node pair relayed

  Paths(const A2aRoute& route, bool rev) : nodes(route.inter->size()), relay(route.relay), reverse(rev) {
    if (!relay) return;
    MOETRAIN_CHECK(relay->size() == static_cast<std::size_t>(nodes) * nodes,
                   "a2a: a relay matrix of {} entries for {} nodes", relay->size(), nodes);
    all_cross = nodes > 1;
    for (int a = 0; a < nodes; ++a)
      for (int b = 0; b < nodes; ++b) all_cross = all_cross && (a == b || (*relay)[a * nodes + b]);
  }
  bool via(int a, int b) const {
    if (!relay || a == b) return all_cross;
    return (*relay)[reverse ? b * nodes + a : a * nodes + b] != 0;
  }
  bool any_direct() const { return !all_cross; }
  bool any_relayed() const {
    for (int a = 0; a < nodes; ++a)
      for (int b = 0; b < nodes; ++b)
        if (via(a, b)) return true;
    return false;
  }
};

// The two stages of a 2-D route as block lists, seen from rank me = (node n, local index l), for
// the node pairs `paths` relays. Rows wait between the stages in a relay buffer: blocks by local
// source k, each by destination node. Every list is in bytes and in the order the peer's message
// is laid out.
struct TwoD {
  int P, L, nodes, n, l;
  int64_t row;
  const A2aLayout& plan;
  const Paths& paths;
  int64_t m(int s, int d) const { return plan.rows[static_cast<std::size_t>(s) * P + d]; }

  TwoD(const A2aLayout& p, const A2aRoute& route, const Paths& pa, int64_t elem_bytes)
      : P(p.P),
        L(route.intra->size()),
        nodes(route.inter->size()),
        n(route.group->rank() / L),
        l(route.group->rank() % L),
        row(p.C * elem_bytes),
        plan(p),
        paths(pa) {}

  // Stage 1, to local rank k: my rows for ranks (d, k), d ascending, from the destination-ordered
  // send buffer.
  std::vector<std::vector<ByteBlock>> stage1_send() const {
    std::vector<int64_t> dest_offset(P, 0);
    for (int d = 1; d < P; ++d) dest_offset[d] = dest_offset[d - 1] + plan.send_rows[d - 1];
    std::vector<std::vector<ByteBlock>> out(L);
    for (int k = 0; k < L; ++k)
      for (int d = 0; d < nodes; ++d) {
        const int dest = d * L + k;
        if (paths.via(n, d) && plan.send_rows[dest] > 0)
          out[k].push_back({dest_offset[dest] * row, plan.send_rows[dest] * row});
      }
    return out;
  }
  // Where relayed rows start: local source k's block.
  std::vector<int64_t> relay_offsets() const {
    std::vector<int64_t> v(L + 1, 0);
    for (int k = 0; k < L; ++k) {
      v[k + 1] = v[k];
      for (int d = 0; d < nodes; ++d)
        if (paths.via(n, d)) v[k + 1] += m(n * L + k, d * L + l);
    }
    return v;
  }
  // Stage 1, from local rank k: its rows for ranks (d, l), into the relay buffer.
  std::vector<std::vector<ByteBlock>> stage1_relay() const {
    const std::vector<int64_t> at = relay_offsets();
    std::vector<std::vector<ByteBlock>> out(L);
    for (int k = 0; k < L; ++k) out[k].push_back({at[k] * row, (at[k + 1] - at[k]) * row});
    return out;
  }
  // Stage 2, to node d: the rows of ranks (n, k), k ascending, for rank (d, l), from the relay.
  std::vector<std::vector<ByteBlock>> stage2_send() const {
    const std::vector<int64_t> at = relay_offsets();
    std::vector<std::vector<ByteBlock>> out(nodes);
    for (int k = 0; k < L; ++k) {
      int64_t within = at[k];
      for (int d = 0; d < nodes; ++d) {
        if (!paths.via(n, d)) continue;
        const int64_t rows = m(n * L + k, d * L + l);
        if (rows > 0) out[d].push_back({within * row, rows * row});
        within += rows;
      }
    }
    return out;
  }
  // Stage 2, from node d: the rows of ranks (d, k), k ascending: one run of the source-major
  // output, since those ranks are consecutive.
  std::vector<std::vector<ByteBlock>> stage2_recv() const {
    std::vector<std::vector<ByteBlock>> out(nodes);
    for (int d = 0; d < nodes; ++d) {
      if (!paths.via(d, n)) continue;
      const int64_t first = plan.recv_offset[d * L], last = plan.recv_offset[(d + 1) * L];
      out[d].push_back({first * row, (last - first) * row});
    }
    return out;
  }
  int64_t relayed() const { return relay_offsets()[L]; }
};

// Byte counts and displacements of row runs laid out one after another.
struct Runs {
  std::vector<int64_t> counts, displs;
  Runs(const std::vector<int64_t>& rows, int64_t C, int64_t elem_bytes)
      : counts(rows.size()), displs(rows.size()) {
    const int64_t row = C * elem_bytes;
    int64_t at = 0;
    for (std::size_t q = 0; q < rows.size(); ++q) {
      counts[q] = rows[q] * row;
      displs[q] = at;
      at += counts[q];
    }
  }
};

// Moves rows of elem_bytes-wide elements; dispatch, or (reverse) combine.
void exchange(void* out, const void* in, const A2aLayout& plan, const A2aRoute& route,
              A2aScratch& scratch, int64_t elem, bool reverse) {
  Comm& comm = *route.group;
  const char* what = reverse ? "a2a_combine" : "a2a_dispatch";
  MOETRAIN_CHECK(comm.size() == plan.P, "{}: plan for {} ranks used on a group of {}", what, plan.P,
                 comm.size());
  const int64_t C = plan.C;
  Runs a(plan.recv_rows, C, elem), b(plan.send_rows, C, elem);
  std::optional<Paths> paths;
  if (route.two_d()) {
    MOETRAIN_CHECK(!plan.rows.empty(), "{}: the plan was made for a flat route", what);
    paths.emplace(route, reverse);
  }
  if (!paths || paths->any_direct()) {
    // Direct: one alltoallv over the group, less the pairs that are relayed.
    if (paths) {
      const int L = route.intra->size(), n = comm.rank() / L;
      for (int q = 0; q < plan.P; ++q) {
        if (paths->via(n, q / L)) b.counts[q] = 0;
        if (paths->via(q / L, n)) a.counts[q] = 0;
      }
    }
    if (reverse) {
      comm.alltoallv(out, b.counts, b.displs, in, a.counts, a.displs);
    } else {
      comm.alltoallv(out, a.counts, a.displs, in, b.counts, b.displs);
    }
  }
  if (!paths || !paths->any_relayed()) return;
  const TwoD t(plan, route, *paths, elem);
  // The relay holds relayed() rows of C elements of elem bytes: at most as many floats.
  float* relay = scratch.relay.ensure(t.relayed() * C);
  if (reverse) {
    // The dispatch with every message going the other way.
    route.inter->alltoallv_blocks(relay, t.stage2_send(), in, t.stage2_recv());
    route.intra->alltoallv_blocks(out, t.stage1_send(), relay, t.stage1_relay());
  } else {
    route.intra->alltoallv_blocks(relay, t.stage1_relay(), in, t.stage1_send());
    route.inter->alltoallv_blocks(out, t.stage2_recv(), relay, t.stage2_send());
  }
}

// Serial on purpose: exchanges may run on the communication thread, whose conversions must not
// start a parallel region that competes with the compute threads.
void exchange_bf16(float* out, const float* in, int64_t rows_in, int64_t rows_out,
                   const A2aLayout& plan, const A2aRoute& route, A2aScratch& scratch,
                   bool reverse) {
  const int64_t n_in = rows_in * plan.C, n_out = rows_out * plan.C;
  bf16* send = static_cast<bf16*>(scratch.send_lp.ensure(n_in));
  bf16* recv = static_cast<bf16*>(scratch.recv_lp.ensure(n_out));
  for (int64_t i = 0; i < n_in; ++i) send[i] = bf16(in[i]);
  exchange(recv, send, plan, route, scratch, 2, reverse);
  for (int64_t i = 0; i < n_out; ++i) out[i] = recv[i].to_float();
}

void check_wire(DType wire) {
  MOETRAIN_CHECK(wire == DType::F32 || wire == DType::BF16,
                 "expert all-to-all payloads in {}: allowed are f32 and bf16", dtype_name(wire));
}

}  // namespace

void a2a_dispatch(float* out, const float* in, const A2aLayout& plan, const A2aRoute& route,
                  A2aScratch& scratch, DType wire) {
  check_wire(wire);
  if (wire == DType::BF16)
    return exchange_bf16(out, in, plan.R_send, plan.R_recv, plan, route, scratch, false);
  exchange(out, in, plan, route, scratch, sizeof(float), false);
}

void a2a_combine(float* out, const float* in, const A2aLayout& plan, const A2aRoute& route,
                 A2aScratch& scratch, DType wire) {
  check_wire(wire);
  if (wire == DType::BF16)
    return exchange_bf16(out, in, plan.R_recv, plan.R_send, plan, route, scratch, true);
  exchange(out, in, plan, route, scratch, sizeof(float), true);
}

}  // namespace moetrain
