#include "dist/alltoall.h"

#include <cstring>

#include "core/check.h"

namespace moetrain {

void a2a_plan(A2aLayout& plan, Comm& comm, const int64_t* counts, int64_t E, int64_t C) {
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
}

namespace {

// Moves block (q, j) between the source-major and the expert-major buffers, in either direction.
void regroup(float* dst, const float* src, const A2aLayout& plan, bool to_expert_major) {
  const int64_t blocks = plan.P * plan.E_local, C = plan.C;
#pragma omp parallel for schedule(static) if (plan.R_recv * C > (1 << 16))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n = plan.recv_counts[b];
    if (n == 0) continue;
    const int64_t from = to_expert_major ? plan.src_offset[b] : plan.exp_offset[b];
    const int64_t to = to_expert_major ? plan.exp_offset[b] : plan.src_offset[b];
    std::memcpy(dst + to * C, src + from * C, static_cast<std::size_t>(n * C) * sizeof(float));
  }
}

// Byte counts and displacements of `rows` row runs laid out one after another.
void row_bytes(std::vector<int64_t>& counts, std::vector<int64_t>& displs,
               const std::vector<int64_t>& rows, int64_t C) {
  const int64_t row = C * static_cast<int64_t>(sizeof(float));
  counts.resize(rows.size());
  displs.resize(rows.size());
  int64_t at = 0;
  for (std::size_t q = 0; q < rows.size(); ++q) {
    counts[q] = rows[q] * row;
    displs[q] = at;
    at += counts[q];
  }
}

}  // namespace

void a2a_dispatch(float* out, const float* in, const A2aLayout& plan, Comm& comm,
                  FloatBuffer& scratch) {
  MOETRAIN_CHECK(comm.size() == plan.P, "a2a_dispatch: plan for {} ranks used on a group of {}",
                 plan.P, comm.size());
  std::vector<int64_t> sc, sd, rc, rd;
  row_bytes(sc, sd, plan.send_rows, plan.C);
  row_bytes(rc, rd, plan.recv_rows, plan.C);
  float* staged = scratch.ensure(plan.R_recv * plan.C);
  comm.alltoallv(staged, rc, rd, in, sc, sd);
  regroup(out, staged, plan, true);
}

void a2a_combine(float* out, const float* in, const A2aLayout& plan, Comm& comm,
                 FloatBuffer& scratch) {
  MOETRAIN_CHECK(comm.size() == plan.P, "a2a_combine: plan for {} ranks used on a group of {}",
                 plan.P, comm.size());
  std::vector<int64_t> sc, sd, rc, rd;
  row_bytes(sc, sd, plan.recv_rows, plan.C);
  row_bytes(rc, rd, plan.send_rows, plan.C);
  float* staged = scratch.ensure(plan.R_recv * plan.C);
  regroup(staged, in, plan, false);
  comm.alltoallv(out, rc, rd, staged, sc, sd);
}

}  // namespace moetrain
