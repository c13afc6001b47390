#include "dist/alltoall.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"

namespace moetrain {

A2aHierarchy make_a2a_hierarchy(Comm& group, int ranks_per_node) {
  MOETRAIN_CHECK(ranks_per_node >= 0, "ranks per node {} must be >= 0 (0 = detect)", ranks_per_node);
  const int P = group.size(), q = group.rank();
  std::unique_ptr<Comm> node;
  if (ranks_per_node > 0) {
    MOETRAIN_CHECK(P % ranks_per_node == 0,
                   "--ranks-per-node {} must divide the {} ranks of the expert-parallel group", ranks_per_node, P);
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
                   "the 2-D all-to-all needs the same number of ranks on every node, packed by rank (rank r on node "
                   "r div L); rank {} has {} ranks on its node, rank {} has {} (use --ranks-per-node or place ranks "
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

  plan.src_offset.assign(P * El, 0);
  plan.exp_offset.assign(P * El, 0);
  int64_t at = 0;
  for (int q = 0; q < P; ++q) {
    for (int64_t j = 0; j < El; ++j) {
      const int64_t n = plan.recv_counts[q * El + j];
      plan.src_offset[q * El + j] = at;
      at += n;
      plan.recv_rows[q] += n;
      plan.expert_counts[j] += n;
    }
  }
  plan.R_recv = at;
  at = 0;
  for (int64_t j = 0; j < El; ++j) {
    for (int q = 0; q < P; ++q) {
      plan.exp_offset[q * El + j] = at;
      at += plan.recv_counts[q * El + j];
    }
  }
  plan.rows.clear();
  if (route.two_d()) {
    MOETRAIN_CHECK(route.intra->size() * route.inter->size() == P,
                   "a2a_plan: a 2-D route of {} x {} ranks over an EP group of {}", route.intra->size(),
                   route.inter->size(), P);
    // Relaying ranks need to know what passes through them: every rank's row counts.
    plan.rows.resize(static_cast<std::size_t>(P) * P);
    comm.allgather(plan.rows.data(), plan.send_rows.data(), std::vector<int64_t>(P, P));
  }
}

namespace {

void copy_rows(float* dst, int64_t dst_row, const float* src, int64_t src_row, int64_t rows, int64_t C) {
  if (rows > 0)
    std::memcpy(dst + dst_row * C, src + src_row * C, static_cast<std::size_t>(rows * C) * sizeof(float));
}

// Moves block (q, j) between the source-major and the expert-major buffers, in either direction.
void regroup(float* dst, const float* src, const A2aLayout& plan, bool to_expert_major) {
  const int64_t blocks = plan.P * plan.E_local, C = plan.C;
#pragma omp parallel for schedule(static) if (plan.R_recv * C > (1 << 16))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t from = to_expert_major ? plan.src_offset[b] : plan.exp_offset[b];
    const int64_t to = to_expert_major ? plan.exp_offset[b] : plan.src_offset[b];
    copy_rows(dst, to, src, from, plan.recv_counts[b], C);
  }
}

// Byte counts and displacements of row runs laid out one after another.
struct Runs {
  std::vector<int64_t> counts, displs;
  explicit Runs(const std::vector<int64_t>& rows, int64_t C) : counts(rows.size()), displs(rows.size()) {
    const int64_t row = C * static_cast<int64_t>(sizeof(float));
    int64_t at = 0;
    for (std::size_t q = 0; q < rows.size(); ++q) {
      counts[q] = rows[q] * row;
      displs[q] = at;
      at += counts[q];
    }
  }
};

// Row counts of the two stages of a 2-D route, seen from rank me = (node n, local index l).
struct TwoD {
  int P, L, nodes, n, l;
  const std::vector<int64_t>& M;  // (P, P) rows s → d
  int64_t m(int s, int d) const { return M[static_cast<std::size_t>(s) * P + d]; }

  TwoD(const A2aLayout& plan, const A2aRoute& route)
      : P(plan.P), L(route.intra->size()), nodes(route.inter->size()), n(route.group->rank() / L),
        l(route.group->rank() % L), M(plan.rows) {}

  // Stage 1, to local rank k: my rows for every rank with local index k, by node.
  std::vector<int64_t> stage1_send() const {
    std::vector<int64_t> v(L, 0);
    for (int k = 0; k < L; ++k)
      for (int d = 0; d < nodes; ++d) v[k] += m(n * L + l, d * L + k);
    return v;
  }
  // Stage 1, from local rank k: its rows for every rank with my local index.
  std::vector<int64_t> stage1_recv() const {
    std::vector<int64_t> v(L, 0);
    for (int k = 0; k < L; ++k)
      for (int d = 0; d < nodes; ++d) v[k] += m(n * L + k, d * L + l);
    return v;
  }
  // Stage 2, to node d: the rows of my node's ranks for rank (d, l).
  std::vector<int64_t> stage2_send() const {
    std::vector<int64_t> v(nodes, 0);
    for (int d = 0; d < nodes; ++d)
      for (int k = 0; k < L; ++k) v[d] += m(n * L + k, d * L + l);
    return v;
  }
  // Stage 2, from node d: the rows of its ranks for me.
  std::vector<int64_t> stage2_recv() const {
    std::vector<int64_t> v(nodes, 0);
    for (int d = 0; d < nodes; ++d)
      for (int k = 0; k < L; ++k) v[d] += m(d * L + k, n * L + l);
    return v;
  }

  // Visits the blocks of the stage-1 send buffer in order: (local k, node d) → rows for rank
  // d·L + k, which sit in the destination-ordered send buffer at dest_offset[d·L + k].
  template <class F>
  void for_stage1_blocks(const std::vector<int64_t>& send_rows, F&& f) const {
    std::vector<int64_t> dest_offset(P, 0);
    for (int d = 1; d < P; ++d) dest_offset[d] = dest_offset[d - 1] + send_rows[d - 1];
    int64_t at = 0;
    for (int k = 0; k < L; ++k)
      for (int d = 0; d < nodes; ++d) {
        const int dest = d * L + k;
        f(at, dest_offset[dest], send_rows[dest]);
        at += send_rows[dest];
      }
  }
  // Visits the blocks of the stage-2 send buffer in order: (node d, local source k) → rows of
  // rank n·L + k for rank d·L + l, which sit in the stage-1 receive buffer (blocks by source k,
  // within each by destination node).
  template <class F>
  void for_stage2_blocks(F&& f) const {
    std::vector<int64_t> relay_offset(L, 0);
    for (int k = 1; k < L; ++k) {
      relay_offset[k] = relay_offset[k - 1];
      for (int d = 0; d < nodes; ++d) relay_offset[k] += m(n * L + k - 1, d * L + l);
    }
    int64_t at = 0;
    for (int d = 0; d < nodes; ++d)
      for (int k = 0; k < L; ++k) {
        int64_t within = 0;
        for (int e = 0; e < d; ++e) within += m(n * L + k, e * L + l);
        const int64_t rows = m(n * L + k, d * L + l);
        f(at, relay_offset[k] + within, rows);
        at += rows;
      }
  }
};

int64_t total(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

void exchange(Comm& comm, float* recv, const std::vector<int64_t>& recv_rows, const float* send,
              const std::vector<int64_t>& send_rows, int64_t C) {
  Runs r(recv_rows, C), s(send_rows, C);
  comm.alltoallv(recv, r.counts, r.displs, send, s.counts, s.displs);
}

}  // namespace

void a2a_dispatch(float* out, const float* in, const A2aLayout& plan, const A2aRoute& route,
                  A2aScratch& scratch) {
  Comm& comm = *route.group;
  MOETRAIN_CHECK(comm.size() == plan.P, "a2a_dispatch: plan for {} ranks used on a group of {}", plan.P,
                 comm.size());
  const int64_t C = plan.C;
  float* staged = scratch.staged.ensure(plan.R_recv * C);
  if (!route.two_d()) {
    exchange(comm, staged, plan.recv_rows, in, plan.send_rows, C);
  } else {
    MOETRAIN_CHECK(!plan.rows.empty(), "a2a_dispatch: the plan was made for a flat route");
    const TwoD t(plan, route);
    const auto s1_send = t.stage1_send(), s1_recv = t.stage1_recv();
    const int64_t relayed = total(s1_recv);
    float* pack = scratch.pack.ensure(std::max(plan.R_send, relayed) * C);
    t.for_stage1_blocks(plan.send_rows, [&](int64_t to, int64_t from, int64_t rows) {
      copy_rows(pack, to, in, from, rows, C);
    });
    float* relay = scratch.relay.ensure(relayed * C);
    exchange(*route.intra, relay, s1_recv, pack, s1_send, C);
    t.for_stage2_blocks([&](int64_t to, int64_t from, int64_t rows) { copy_rows(pack, to, relay, from, rows, C); });
    exchange(*route.inter, staged, t.stage2_recv(), pack, t.stage2_send(), C);
  }
  regroup(out, staged, plan, true);
}

void a2a_combine(float* out, const float* in, const A2aLayout& plan, const A2aRoute& route,
                 A2aScratch& scratch) {
  Comm& comm = *route.group;
  MOETRAIN_CHECK(comm.size() == plan.P, "a2a_combine: plan for {} ranks used on a group of {}", plan.P,
                 comm.size());
  const int64_t C = plan.C;
  float* staged = scratch.staged.ensure(plan.R_recv * C);
  regroup(staged, in, plan, false);
  if (!route.two_d()) {
    exchange(comm, out, plan.send_rows, staged, plan.recv_rows, C);
    return;
  }
  MOETRAIN_CHECK(!plan.rows.empty(), "a2a_combine: the plan was made for a flat route");
  const TwoD t(plan, route);
  const auto s1_send = t.stage1_send(), s1_recv = t.stage1_recv();
  const int64_t relayed = total(s1_recv);
  float* pack = scratch.pack.ensure(std::max(plan.R_send, relayed) * C);
  exchange(*route.inter, pack, t.stage2_send(), staged, t.stage2_recv(), C);
  float* relay = scratch.relay.ensure(relayed * C);
  t.for_stage2_blocks([&](int64_t from, int64_t to, int64_t rows) { copy_rows(relay, to, pack, from, rows, C); });
  exchange(*route.intra, pack, s1_send, relay, s1_recv, C);
  t.for_stage1_blocks(plan.send_rows, [&](int64_t from, int64_t to, int64_t rows) {
    copy_rows(out, to, pack, from, rows, C);
  });
}

}  // namespace moetrain
