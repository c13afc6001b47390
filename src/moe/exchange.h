// How the MoE layer reaches the experts of other processes: the ExpertExchange interface, in
// DeepEP's style. For one run of tokens (a chunk) the layer hands over how many rows it routes
// to each global expert; plan() turns that into a layout handle (collective: every process of
// the expert-parallel group learns what it receives), and dispatch() / combine() move rows to
// the experts' owners and back over that handle. The backward reuses the forward's handle: the
// backward of a dispatch is a combine and the backward of a combine is a dispatch.
//
// Ownership: an EP group of P processes, the one with index q computes experts
// [q·E/P, (q+1)·E/P). Rows arrive source-major (process 0's rows, by local expert, then
// process 1's, ...), each source's block grouped by expert, so the experts run once per source
// block and no row is regrouped.
//
// Exchange work (plan, dispatch, combine) goes through post(): an exchange with a communication
// thread queues it there and returns a ticket that wait() blocks on, so the layer computes the
// experts of one chunk while another chunk's rows travel; otherwise post() runs the work at once.
// Work runs one task at a time in the order posted, on every process in the same order.
//
// LocalExchange is the identity (P = 1): every expert is here and nothing moves. The MPI
// exchange lives in parallel/mpi_exchange.h.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/buffer.h"

namespace moetrain {

// Which experts a process computes, out of E.
struct ExpertOwnership {
  int P = 1;  // processes of the EP group
  int q = 0;  // this process's index in it
  int64_t count(int64_t E) const { return E / P; }
  int64_t first(int64_t E) const { return q * (E / P); }
};

// The layout handle of one exchange.
struct ExchangeLayout {
  int P = 1;                           // processes of the EP group
  int64_t E_local = 0;                 // experts per process, El
  int64_t C = 0;                       // floats per row
  int64_t R_send = 0;                  // rows this process sends (its routed rows)
  int64_t R_recv = 0;                  // rows this process receives (its experts' rows)
  std::vector<int64_t> send_rows;      // (P) rows to process q
  std::vector<int64_t> recv_rows;      // (P) rows from process q
  std::vector<int64_t> recv_counts;    // (P, El) rows from process q for local expert j
  std::vector<int64_t> recv_offset;    // (P + 1) first received row from process q
  std::vector<int64_t> expert_counts;  // (El) rows per local expert, summed over sources
  std::vector<int64_t> rows;           // 2-D routes only: (P, P) rows from process s to d
};

// Seconds spent in exchange work and waiting for it, and bytes sent, since the last take_times().
struct ExchangeTimes {
  double busy = 0;    // inside plan / dispatch / combine, wherever they ran
  double waited = 0;  // the caller blocked: work run inline, or wait() on queued work
  // Sent by this process to the others of its group: the plan's row counts and the rows of
  // dispatches and combines, in the wire type (nothing to itself).
  int64_t bytes = 0;
};

class ExpertExchange {
 public:
  using Ticket = uint64_t;
  virtual ~ExpertExchange() = default;

  virtual ExpertOwnership ownership() const = 0;
  // How many consecutive runs of tokens the layer cuts a batch into, each with its own layout
  // and exchange (≥ 1). More than one only pays with a communication thread to overlap them.
  virtual int chunks() const = 0;

  // Runs `work` on the communication thread (returns its ticket) or here (returns 0).
  virtual Ticket post(std::function<void()> work) = 0;
  // Returns once task `t` and every task posted before it have finished (0: at once).
  virtual void wait(Ticket t) = 0;
  virtual ExchangeTimes take_times() = 0;

  // Collective over the EP group. counts (E): rows this process routes to each global expert,
  // grouped by expert in the send buffer; E must be a multiple of P.
  virtual void plan(ExchangeLayout& layout, const int64_t* counts, int64_t E, int64_t C) = 0;
  // Collective. The rows (R_recv, C, source-major) of this process's experts, given every
  // process's send (R_send, C): either `recv` filled, or `send` itself when nothing moves.
  virtual const float* dispatch(const float* send, const ExchangeLayout& layout,
                                FloatBuffer& recv) = 0;
  // Collective, the reverse. rows (R_recv, C, source-major) returned to the processes and
  // positions they were dispatched from: (R_send, C), in `back` or `rows` itself.
  virtual const float* combine(const float* rows, const ExchangeLayout& layout,
                               FloatBuffer& back) = 0;
};

// One process: every expert here, work runs inline, rows stay where they are.
class LocalExchange final : public ExpertExchange {
 public:
  ExpertOwnership ownership() const override { return {}; }
  int chunks() const override { return 1; }
  Ticket post(std::function<void()> work) override {
    work();
    return 0;
  }
  void wait(Ticket) override {}
  ExchangeTimes take_times() override { return {}; }
  void plan(ExchangeLayout& layout, const int64_t* counts, int64_t E, int64_t C) override;
  const float* dispatch(const float* send, const ExchangeLayout&, FloatBuffer&) override {
    return send;
  }
  const float* combine(const float* rows, const ExchangeLayout&, FloatBuffer&) override {
    return rows;
  }
};

}  // namespace moetrain
