// The part of the MoE layer between routing and the weighted combine: the routed rows of a batch
// grouped by expert (dispatch.h), sent to the experts' owners (exchange.h), run through this
// process's experts (experts.h) and brought back — and the same in reverse for the backward.
//
// Chunks: the exchange's chunks() = n cuts the batch into n consecutive runs of tokens, each with
// its own layout and exchange. With a communication thread the exchange of one chunk runs while
// the experts compute another (forward: every dispatch is posted at once, each combine as soon as
// its experts are done; the backward likewise). Results depend on n, never on the thread.
// Between posting the dispatches and computing the experts the caller runs its own work (the
// shared expert), which overlaps the first exchange.
#pragma once
#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "core/comm.h"
#include "moe/config.h"
#include "moe/dispatch.h"
#include "moe/exchange.h"
#include "moe/experts.h"
#include "moe/placement.h"
#include "moe/recompute.h"
#include "moe/router.h"

namespace moetrain {

// The row buffers of one chunk: (R_send, C) rows this process routed, out and back, and
// (R_recv, C) rows of this process's experts, source-major.
struct PipelineRows {
  FloatBuffer xp, y, dy, dxp;
  FloatBuffer xr, yr, dyr, dxr;
};

// Working buffers the MoE layers of one model share under activation recomputation: what a layer
// needs only while its forward, or its recompute and backward, runs (one layer at a time) —
// under moe the experts' intermediates, under full also the row buffers.
struct RecomputeScratch {
  std::vector<PipelineRows> rows;             // (chunks) full only
  std::vector<std::vector<ExpertActs>> acts;  // (chunks) of (P) or (P, El) under a placement
  FloatBuffer y;                              // moe: the recomputed expert outputs, not used
  ExpertActs shared_acts;                     // the shared expert's intermediates
  FloatBuffer shared_y;                       // moe: the recomputed shared expert output
  int64_t bytes() const {
    int64_t n = y.bytes() + shared_y.bytes() + shared_acts.forward_bytes() +
                shared_acts.scratch_bytes();
    for (const PipelineRows& r : rows)
      for (const FloatBuffer* b : {&r.xp, &r.y, &r.dy, &r.dxp, &r.xr, &r.yr, &r.dyr, &r.dxr})
        n += b->bytes();
    for (const auto& v : acts)
      for (const ExpertActs& a : v) n += a.forward_bytes() + a.scratch_bytes();
    return n;
  }
};

// Seconds spent per stage in the last forward plus the backward that followed it.
// a2a: exchanging token rows with other processes (0 when nothing moves); a2a_wait: the part of
// it the layer waited for, not hidden behind compute (= a2a without overlap; not counted again in
// total()).
struct MoeTimings {
  double router = 0, permute = 0, experts = 0, shared = 0, combine = 0, losses = 0, a2a = 0;
  double a2a_wait = 0;
  int64_t a2a_bytes = 0;  // sent to other processes in the exchanges (ExchangeTimes::bytes)
  double total() const { return router + permute + experts + shared + combine + losses + a2a; }
};

// Expert tensor parallelism (etp, a group of T ranks, null or one rank: off): the ranks of an ETP
// group hold the same experts (each in its own EP group). After the exchange every rank
// all-gathers the rows its ETP peers received, runs each of its experts over all of them on its
// shard of the hidden units (rows [s·F/T, (s+1)·F/T) of w1 and w3, those columns of w2; s its
// rank in the group), and reduce-scatters the partial outputs back to the rows each peer
// brought. The backward mirrors it: the output gradients all-gathered, the partial input
// gradients reduce-scattered, and each rank adds the gradients of its shard only.
class ExpertPipeline {
 public:
  // Throws unless the exchange's group size divides cfg.E, it asks for at least one chunk, and
  // the ETP group's size divides cfg.F.
  ExpertPipeline(const MoeConfig& cfg, ExpertExchange& exchange, Comm* etp = nullptr);

  // This process's experts (its slots under a placement).
  int64_t first_expert() const { return first_; }
  int64_t local_experts() const { return E_local_; }
  // Hot-expert replication (moe/placement.h, moe/slot_routing.h): the exchange carries p's slots
  // and this process computes its slots, each with its logical expert's weights; send() then
  // takes a routing over the slots. p (same E, same group size) must outlive its use; null
  // restores one slot per expert.
  void set_placement(const Placement* p);
  int64_t received_rows() const;
  // Per expert (E): rows this process routed in the last forward; tokens with no row.
  void routed_counts(int64_t* tokens_per_expert, int64_t* unrouted_tokens) const;

  // Forward, in three calls: send lays out and permutes inp (N, C) by the routing and posts the
  // exchanges; compute runs this process's experts as the rows land and posts the returns;
  // combine waits for them and adds the weighted rows into out (N, C) (= without accumulate).
  // routing must stay unchanged until backward has run.
  void send(const float* inp, const Routing& routing, MoeTimings& t);
  void compute(const MoeWeights& w, MoeTimings& t);
  void combine(float* out, bool accumulate, MoeTimings& t);

  // Backward, in the same three calls: send takes dout (N, C) and writes dweight (N, S) (the
  // gradient on the routing weights) and posts the exchanges; compute adds this process's
  // expert gradients into g; combine waits and writes dinp (N, C) (+= with accumulate).
  void send_backward(float* dweight, const float* dout, MoeTimings& t);
  void compute_backward(const MoeWeights& w, const MoeWeights& g, MoeTimings& t);
  void combine_backward(float* dinp, bool accumulate, MoeTimings& t);

  // Activation recomputation (moe/recompute.h). moe: compute() drops each chunk's expert
  // intermediates once its rows are out, and compute_backward() computes them again from the
  // rows received (no exchange) right before the experts' backward, then drops them again.
  // full: the caller drops everything after the forward (release()) and, before the backward,
  // calls replay_send(), compute() and combine() again: the same layouts and exchange plans,
  // the rows exchanged again.
  // scratch: the buffers shared with the model's other layers (null: this pipeline's own).
  void set_recompute(Recompute r, RecomputeScratch* scratch = nullptr);
  // send() over the layouts and plans of the last send(): inp (N, C) as it was.
  void replay_send(const float* inp, MoeTimings& t);
  // Gives back every row buffer and intermediate; the layouts and plans stay.
  void release();
  // Bytes held in row buffers and expert intermediates (the backward's scratch included).
  int64_t held_bytes() const;

 private:
  // One run of consecutive tokens with its own layout and exchange.
  struct Chunk {
    int64_t t0 = 0, N = 0;  // tokens [t0, t0 + N)
    int index = 0;          // in chunks_
    Routing routing;        // the chunk's slice of the routing
    DispatchLayout layout;
    ExchangeLayout plan;
    PipelineRows own_rows;  // rows() unless shared
    // Where the exchange left the rows: a buffer above, or the rows sent when nothing moves.
    const float* xr_rows = nullptr;   // (R_recv, C)
    const float* y_rows = nullptr;    // (R_send, C)
    const float* dyr_rows = nullptr;  // (R_recv, C)
    const float* dxp_rows = nullptr;  // (R_send, C)
    std::vector<ExpertActs> own_acts;  // acts() unless shared
    // Expert tensor parallelism: the rows of every ETP peer, peer-major (Rg = Σ peer_rows).
    FloatBuffer xg, yg, dyg, dxg;       // (Rg, C): rows, partial outputs, output and input grads
    std::vector<int64_t> peer_counts;   // (T, P, El) each peer's recv_counts
    std::vector<int64_t> peer_rows;     // (T) each peer's R_recv
  };
  PipelineRows& rows(Chunk& k) {
    return scratch_ && recompute_ == Recompute::Full ? scratch_->rows[k.index] : k.own_rows;
  }
  // (P) one per source block; (P, El) under a placement
  std::vector<ExpertActs>& acts(Chunk& k) { return scratch_ ? scratch_->acts[k.index] : k.own_acts; }
  void size_acts();

  // Forward (g null) into y_out (k.yr when null), or backward.
  void experts(Chunk& k, const MoeWeights& w, const MoeWeights* g, MoeTimings& t,
               float* y_out = nullptr);
  void add_times(MoeTimings& t);
  // experts() under expert tensor parallelism.
  void etp_experts(Chunk& k, const MoeWeights& w, const MoeWeights* g, float* out);
  // This rank's shard of experts [first_, first_ + E_local_) of w, copied into `into`.
  ExpertRange etp_shard(const MoeWeights& w, FloatBuffer (&into)[3]) const;

  MoeConfig cfg_;
  ExpertExchange& ex_;
  int64_t first_ = 0, E_local_ = 0;
  int64_t E_ex_ = 0;  // experts the exchange sees: E, or the placement's slots
  int P_ = 1, q_ = 0;
  const Placement* placement_ = nullptr;
  std::vector<int32_t> slot_expert_;  // (El) logical expert of each local slot, under a placement
  std::vector<Chunk> chunks_;
  std::vector<ExpertExchange::Ticket> landed_, returned_;  // (chunks)
  Recompute recompute_ = Recompute::None;
  RecomputeScratch* scratch_ = nullptr;
  FloatBuffer recompute_y_;  // moe without scratch: the recomputed expert outputs, not used
  Comm* etp_ = nullptr;      // the ETP group; null when off
  int T_ = 1, s_ = 0;        // its size and this rank's place
  int64_t Fs_ = 0;           // hidden units of an expert's shard: F / T
  FloatBuffer wshard_[3], gshard_[3];  // w1, w3 (El, Fs, C), w2 (El, C, Fs) and their gradients
};

}  // namespace moetrain
