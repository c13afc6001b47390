// The expert all-to-all: routed token rows travel from the rank that holds the token to the rank
// that owns the expert, and expert outputs travel back. As in DeepEP, the layout is computed
// first (per-rank, per-expert row counts, exchanged once per forward) and kept as a handle: the
// dispatch, the combine and both their backwards (a dispatch's backward is a combine and vice
// versa) reuse it.
//
// On the sending side rows are grouped by global expert (DispatchLayout order), and the experts
// of rank q are [q·El, (q+1)·El), so the rows for rank q are one contiguous run. The receiving
// side regroups what arrives (source-major: rank 0's rows for each local expert, then rank 1's)
// into expert-major order (all rows of local expert 0, source rank ascending, then expert 1),
// which is what the grouped expert GEMMs take.
#pragma once
#include <cstdint>
#include <vector>

#include "dist/comm.h"
#include "moe/workspace.h"

namespace moetrain {

struct A2aLayout {
  int P = 1;             // ranks of the EP group
  int64_t E_local = 0;   // experts per rank, El
  int64_t C = 0;         // floats per row
  int64_t R_send = 0;    // rows this rank sends (its routed rows)
  int64_t R_recv = 0;    // rows this rank receives (its experts' rows)
  std::vector<int64_t> send_rows;      // (P) rows to rank q
  std::vector<int64_t> recv_rows;      // (P) rows from rank q
  std::vector<int64_t> recv_counts;    // (P, El) rows from rank q for local expert j
  std::vector<int64_t> expert_counts;  // (El) rows per local expert, summed over sources
  std::vector<int64_t> src_offset;     // (P, El) first row of block (q, j), source-major
  std::vector<int64_t> exp_offset;     // (P, El) first row of block (q, j), expert-major
};

// Collective over comm (the EP group). counts (E): rows this rank routes to each global expert;
// E must be a multiple of comm.size().
void a2a_plan(A2aLayout& plan, Comm& comm, const int64_t* counts, int64_t E, int64_t C);

// Collective. out (R_recv, C) expert-major = the rows of in (R_send, C) sent by every rank.
// scratch holds the source-major rows in between.
void a2a_dispatch(float* out, const float* in, const A2aLayout& plan, Comm& comm,
                  FloatBuffer& scratch);
// Collective, the reverse. out (R_send, C) = the rows of in (R_recv, C, expert-major) returned to
// the ranks and positions they were dispatched from.
void a2a_combine(float* out, const float* in, const A2aLayout& plan, Comm& comm,
                 FloatBuffer& scratch);

}  // namespace moetrain
