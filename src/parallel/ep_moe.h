// The MoE layer with its experts spread over an expert-parallel (EP) group: MoeLayer's stages
// with an all-to-all between permute and the experts and another between the experts and
// combine (parallel/alltoall.h). Every rank routes its own tokens; rank q of the EP group computes
// experts [q·E/P, (q+1)·E/P) for the tokens of the whole group. The backward runs the same
// exchanges in reverse over the same layouts. An expert or a rank with no rows costs nothing and
// blocks nothing: zero-size messages are still exchanged.
//
// Overlap: with `chunks` = n > 1 a rank's tokens are cut into n consecutive runs, each with its
// own layout and exchange, and with a CommThread the exchanges of one chunk run while the experts
// compute another (forward: all dispatches are posted at once, each combine as soon as its
// experts are done; the backward likewise). Results do not depend on the thread, only on n.
//
// Whatever is a statistic over tokens is taken over every process of the run (the `stats`
// communicator), so that a run on P processes with B sequences each computes what one process
// computes with P·B:
//   - the aux loss uses the global f_i and P_i (its gradient on this rank's tokens is
//     E·f_i/N_local times the loss weight, which the trainer sets to 1/processes);
//   - sigmoid_bias loads: pending_load() is local; the trainer sums it over the run.
// Per rank, as on one process with that rank's tokens: capacity dropping (each rank's own
// capacity), expert_choice selection, and noisy_topk noise (drawn by local token index).
#pragma once
#include <cstdint>
#include <vector>

#include "core/comm.h"
#include "moe/moe_block.h"
#include "moe/moe_layer.h"
#include "parallel/alltoall.h"
#include "parallel/comm_thread.h"

namespace moetrain {

struct EpOptions {
  int chunks = 1;                // token chunks per exchange (≥ 1)
  CommThread* thread = nullptr;  // runs the exchanges when set (must outlive the layer)
  // Element type of the token rows and their gradients on the wire (F32 or BF16, half the
  // bytes). In bf16 the rows arrive rounded; the experts and the combine still compute in f32
  // (or in the model's precision).
  DType a2a_dtype = DType::F32;
};

class ExpertParallelMoe final : public MoeBlock {
 public:
  // route: the EP group (its size must divide cfg.E), flat or 2-D. stats: every process that
  // holds tokens. The communicators must outlive the layer.
  ExpertParallelMoe(const MoeConfig& cfg, const A2aRoute& route, Comm& stats,
                    const EpOptions& opts = {});
  ExpertParallelMoe(const MoeConfig& cfg, Comm& a2a, Comm& stats)
      : ExpertParallelMoe(cfg, A2aRoute{&a2a}, stats) {}

  // Collective over the route and stats: every rank calls it, with any N ≥ 0 (also 0).
  void forward(float* out, const float* inp, int64_t N, const MoeWeights& w,
               const MoeStep& step) override;
  // Collective over the route. Touches only this rank's expert gradients, the gate (and noise,
  // shared expert) gradients.
  void backward(float* dinp, const float* dout, const MoeWeights& w, const MoeWeights& g,
                float loss_weight) override;

  float aux_loss() const override { return aux_loss_; }
  float z_loss() const override { return z_loss_; }
  const MoeStats& stats() const override { return stats_; }
  const MoeTimings& timings() const override { return timings_; }
  const MoeConfig& config() const override { return cfg_; }
  const int64_t* pending_load() const override { return pending_load_.data(); }
  void apply_bias_update(const int64_t* global_load) override;
  float* router_bias() override { return bias_.data(); }

  int64_t first_expert() const { return first_; }
  int64_t local_experts() const { return E_local_; }
  // Rows this rank's experts received in the last forward, over all chunks.
  int64_t received_rows() const;

 private:
  // One run of consecutive tokens with its own layout and exchange.
  struct Chunk {
    int64_t t0 = 0, N = 0;  // tokens [t0, t0 + N)
    Routing routing;        // the chunk's slice of the routing
    DispatchLayout layout;
    A2aLayout plan;
    FloatBuffer xp, y, dy, dxp;    // (R_send, C) rows this rank routed
    FloatBuffer xr, yr, dyr, dxr;  // (R_recv, C) rows of this rank's experts, source-major
    std::vector<ExpertActs> acts;  // (P) one per source block
    A2aScratch scratch;
  };

  void balance_losses(int64_t N);
  // Runs `task` on the comm thread (returns its ticket) or here (returns 0).
  CommThread::Ticket communicate(std::function<void()> task);
  void wait(CommThread::Ticket t);
  void experts(Chunk& k, const MoeWeights& w, bool forward, const MoeWeights* g);

  MoeConfig cfg_;
  A2aRoute route_;
  Comm& a2a_;
  Comm& stats_comm_;
  EpOptions opts_;
  int64_t first_ = 0, E_local_ = 0;
  std::vector<float> bias_;
  std::vector<int64_t> pending_load_;

  bool has_forward_ = false;
  int64_t N_ = 0;
  const float* inp_ = nullptr;
  Routing routing_;
  RouterCache router_cache_;
  std::vector<Chunk> chunks_;
  std::vector<float> frac_;  // (E) global f_i of the aux loss
  float aux_loss_ = 0.0f, z_loss_ = 0.0f;
  MoeStats stats_;
  MoeTimings timings_;
  double a2a_busy_ = 0;  // written by exchanges (on the comm thread when there is one)
  ExpertActs shared_acts_;
  std::vector<float> dweight_, dprobs_, dz_;  // (N, S), (N, E), (N, E)
};

}  // namespace moetrain
