// The Mixture-of-Experts layer: tokens (N, C) in, (N, C) out, exact backward, on one process or
// with its experts spread over an expert-parallel group — the ExpertExchange decides which.
// The forward runs as separable stages, each a public function of its own file:
//   route (router.h) → capacity → balancing losses (balance.h) → layout + permute (dispatch.h)
//   → dispatch (exchange.h) → experts (experts.h) → combine (exchange.h) → weighted combine
// The stages from the layout to the combine run per chunk (expert_pipeline.h); the backward
// runs them in reverse over the same layouts.
//
// Every process routes its own tokens; with an EP group of P processes, process q computes
// experts [q·E/P, (q+1)·E/P) for the tokens of the whole group. The layer is collective over the
// exchange and the stats communicator: every process calls forward and backward, with any N ≥ 0
// (also 0: zero-size messages are still exchanged).
//
// What the layer computes over every process of the run (the `stats` communicator, so that P
// processes with B sequences each compute what one process computes with P·B):
//   - the balance loss, with the global f_i and P_i (its gradient on this process's tokens is
//     E·f_i/N_local — for the variance loss ∂L_var/∂P_i / N_local — times the loss weight, which
//     the trainer sets to 1/processes), and the
//     z-loss, the mean over every token (gradient likewise);
// Per process, as on one process with that process's tokens: capacity dropping or rerouting
// (each process's own capacity; with capacity_factor < 0 one capacity for all, from the largest
// load needed on any process), expert_choice selection, the statistics in MoeStats and sigmoid_bias
// loads (pending_load(); the trainer sums them over the run). noisy_topk noise is drawn per global
// token (MoeStep::token_offset), so a split run draws what the one-process run draws.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/comm.h"
#include "moe/config.h"
#include "moe/exchange.h"
#include "moe/expert_pipeline.h"
#include "moe/router.h"

namespace moetrain {

// Routing outcome of the last forward, on this process's tokens.
struct MoeStats {
  std::vector<int64_t> tokens_per_expert;  // (E) assignments each expert computed, after dropping
  int64_t assignments = 0;                 // assignments the router made, before dropping
  int64_t dropped = 0;                     // assignments dropped for capacity (after rerouting)
  int64_t rerouted = 0;                    // assignments moved to another expert (reroute)
  double fraction_dropped = 0.0;           // dropped / assignments (0 when there are none)
  int64_t capacity = 0;                    // per-expert capacity in force, 0 = dropless
  int64_t needed = 0;        // largest load any expert got before dropping (over the stats comm
                             // when capacity_factor < 0, else this process's)
  float capacity_factor = 0; // the factor in effect
  int64_t unrouted_tokens = 0;             // tokens that reached no expert
};

// What runs the MoE layers of a model besides this process's compute. Null members: local ones
// (every expert here, statistics over this process), owned by the layer.
struct MoeContext {
  ExpertExchange* exchange = nullptr;  // must outlive the layers
  Comm* stats = nullptr;               // every process that holds tokens; must outlive the layers
  // Expert tensor parallelism: the ranks sharing this rank's experts' hidden units
  // (moe/expert_pipeline.h); null: each expert whole here. Must outlive the layers.
  Comm* etp = nullptr;
};

class MoeLayer {
 public:
  explicit MoeLayer(const MoeConfig& cfg, const MoeContext& ctx = {});

  // out (N, C) = MoE(inp (N, C)). Keeps what backward needs until the next forward; inp is not
  // copied, so it must stay valid and unchanged until backward has run.
  void forward(float* out, const float* inp, int64_t N, const MoeWeights& w, const MoeStep& step);
  // dinp (N, C) =; parameter gradients += into g (an expert that got no tokens is left untouched,
  // and so are the experts of other processes); adds loss_weight · (aux_loss_coef · ∂L_aux +
  // z_loss_coef · ∂L_z). dout (N, C)
  void backward(float* dinp, const float* dout, const MoeWeights& w, const MoeWeights& g,
                float loss_weight);

  // Activation recomputation (moe/recompute.h). moe: the experts' and the shared expert's
  // intermediates are dropped after the forward and computed again inside backward. full: the
  // forward keeps its routing (the router's scores, top-k experts and weights after capacity
  // dropping or rerouting, the noise drawn, the capacity in force, the balancing losses' figures)
  // and drops its rows and intermediates; recompute_forward(out, inp, w) must then run before
  // backward: it replays that routing on inp (the forward's input, computed again: bitwise the
  // same) — no new routing, statistics, bias loads or timings — exchanging the rows again
  // (collective over the exchange, like forward), and writes the same out.
  // scratch: working buffers shared with the model's other MoE layers (null: the layer's own).
  void set_recompute(Recompute r, RecomputeScratch* scratch = nullptr);
  Recompute recompute() const { return recompute_; }
  void recompute_forward(float* out, const float* inp, const MoeWeights& w);
  // Bytes this layer holds for its backward now: routing, router scores, rows, intermediates and
  // backward scratch.
  int64_t held_bytes() const;

  // The layer for an engine that runs its GEMMs and expert compute itself (the CUDA backend),
  // keeping here everything a router decides: routing, capacity, balancing losses, statistics,
  // the sigmoid_bias loads. Forward: fill logits_for(N) (N, E) with inp·gateᵀ (and
  // noise_logits() with inp·noiseᵀ for noisy_topk), route(N, step) decides, the engine dispatches
  // routing() and computes the experts, finish_route(counts) records the rows each expert got.
  // Backward: logit_grads(dweight (N, S), loss_weight) returns ∂/∂logits (N, E) (and
  // noise_logit_grads() for noisy_topk while training) for the engine's router GEMMs. One process,
  // no replicas.
  float* logits_for(int64_t N);
  float* noise_logits() { return router_cache_.noise_logits.data(); }
  const Routing& route(int64_t N, const MoeStep& step);
  void finish_route(const int64_t* counts);
  const float* logit_grads(const float* dweight, float loss_weight);
  const float* noise_logit_grads() const {
    return router_cache_.noisy ? router_cache_.dnoise_logits.data() : nullptr;
  }

  // Unweighted balancing losses of the last forward (aux is 0 for expert_choice and sigmoid_bias).
  float aux_loss() const { return aux_loss_; }
  float z_loss() const { return z_loss_; }
  const MoeStats& stats() const { return stats_; }
  const MoeTimings& timings() const { return timings_; }
  const Routing& routing() const { return routing_; }
  const MoeConfig& config() const { return cfg_; }
  // The capacity factor of the next forwards (the dynamic capacity controller moves it); the
  // sign picks the mode as in MoeConfig::capacity_factor. Token-choice routers only.
  void set_capacity_factor(float cf);
  float capacity_factor() const { return cf_; }
  // This process's experts [first_expert(), first_expert() + local_experts()).
  int64_t first_expert() const { return pipeline_.first_expert(); }
  int64_t local_experts() const { return pipeline_.local_experts(); }
  // Hot-expert replication (moe/placement.h): the next forwards route each assignment to one of
  // its expert's replica slots (moe/slot_routing.h) and this process computes its slots of p.
  // Call again after p changes; null: one slot per expert. The replicas' weights must equal their
  // logical experts' (parallel/replica_sync.h), and their gradients land at the logical experts'
  // in g, on whichever process computed them.
  void set_placement(const Placement* p);
  const Placement* placement() const { return placement_; }
  // Rows this process's experts received in the last forward, over all chunks.
  int64_t received_rows() const { return pipeline_.received_rows(); }

  // sigmoid_bias. Assignments per expert (E) chosen by training forwards since the last update,
  // before capacity dropping; a distributed trainer sums them over processes and hands the sum to
  // apply_bias_update, which applies b_i += γ·sign(mean − load_i) and clears the pending counts.
  const int64_t* pending_load() const { return pending_load_.data(); }
  void apply_bias_update(const int64_t* global_load);
  void apply_bias_update() { apply_bias_update(pending_load_.data()); }
  // Moves another copy's pending counts (a pipeline's activation slot ran some of the step's
  // forwards) into this layer's: they add, and `from`'s are cleared.
  void take_pending_load(MoeLayer& from);
  // The same under a gating controller: b_i += γ·delta_i (delta (E) its action), then the
  // pending counts are cleared.
  void apply_bias_delta(const double* delta);
  // The bias b (E), for checkpoints.
  float* router_bias() { return bias_.data(); }
  const float* router_bias() const { return bias_.data(); }

 private:
  void begin_forward(int64_t N, const float* inp);
  void after_routing(const MoeStep& step);  // capacity, balancing losses, sigmoid_bias loads
  void reroute();  // model.overflow = reroute, after apply_capacity
  void finish_stats();
  RouterGrads router_grads(const float* dweight, float loss_weight);

  MoeConfig cfg_;
  float cf_ = 0.0f;
  std::unique_ptr<ExpertExchange> own_exchange_;  // when the context has none
  std::unique_ptr<Comm> own_stats_;               // when the context has none
  Comm& stats_comm_;
  ExpertPipeline pipeline_;
  std::vector<float> bias_;
  std::vector<int64_t> pending_load_;
  const Placement* placement_ = nullptr;
  Routing slot_routing_;  // routing_ over the placement's slots

  // State of the last forward.
  bool has_forward_ = false;
  int64_t N_ = 0;
  const float* inp_ = nullptr;
  Routing routing_;
  RouterCache router_cache_;
  // (E) what the balance loss's backward needs: the global f_i (switch) or ∂L_var/∂P_i (variance)
  std::vector<float> frac_;
  std::vector<float> selection_keys_;  // (N, E) reroute scratch
  float aux_loss_ = 0.0f, z_loss_ = 0.0f;
  MoeStats stats_;
  MoeTimings timings_;
  ExpertActs shared_acts_;
  Recompute recompute_ = Recompute::None;
  bool needs_replay_ = false;  // full: forward ran, recompute_forward not yet
  FloatBuffer shared_y_;       // moe: the recomputed shared expert output, not used
  RecomputeScratch* scratch_ = nullptr;
  ExpertActs& shared_acts() { return scratch_ ? scratch_->shared_acts : shared_acts_; }
  FloatBuffer& shared_y() { return scratch_ ? scratch_->shared_y : shared_y_; }
  std::vector<float> dweight_, dprobs_, dz_;  // (N, S), (N, E), (N, E)
};

}  // namespace moetrain
