// Routing policies: which experts each token goes to and with what combine weight.
// Router math is f32 whatever the activation dtype.
//
//   topk_softmax   p = softmax(l); top-K of l; w = p_k / Σ_kept p (or p_k without renormalize)
//   noisy_topk     H = l + softplus(x·Wnᵀ)·ε while training (ε ~ N(0,1) from the counter RNG at
//                  index token·E + e), H = l in eval; top-K of H; w = softmax over the kept H
//   expert_choice  p = softmax(l); expert e takes its top-Cap tokens by p[:, e]; w = p
//   sigmoid_bias   s = σ(l); top-K of s + b; w = s_k / Σ_kept s (or s_k without renormalize)
// with l = x·gateᵀ. Ties go to the lower expert (token) index.
//
// Group-limited routing (MoeConfig::route_groups G > 1, token-choice routers): before the top-K,
// each token keeps its best route_group_topk groups of E/G contiguous experts, a group ranked by
// the sum of its top-min(K, E/G) scores (p for topk_softmax, softmax(H) for noisy_topk, s + b for
// sigmoid_bias), and the top-K is taken among the kept experts only. The mask is a selection like
// the top-K itself, so the weights and the backward above hold unchanged: masked experts get no
// weight and no gradient through the weights.
#pragma once
#include <cstdint>
#include <vector>

#include "moe/config.h"

namespace moetrain {

// One forward's routing decision. Every token has S slots: K for token-choice routers, E for
// expert choice (slot e is expert e). An expert id of -1 marks an empty or dropped slot.
struct Routing {
  int64_t N = 0, E = 0, S = 0;
  std::vector<int32_t> selected;  // (N, S) the router's choice, before capacity dropping
  std::vector<int32_t> expert;    // (N, S) what is dispatched, after dropping
  std::vector<float> weight;      // (N, S) combine weight of each selected slot (0 where empty)
};

// The expert slot i's weight is a function of the score of: the dispatched one, or for a dropped
// slot the router's choice (model.overflow = reroute moves a slot to another expert, whose score
// its weight then is; router_backward differentiates through these).
inline int32_t weight_expert(const Routing& r, int64_t i) {
  return r.expert[i] >= 0 ? r.expert[i] : r.selected[i];
}

// What router_backward needs from the forward, and its scratch.
struct RouterCache {
  int64_t N = 0;
  bool noisy = false;               // noise was added (noisy_topk while training)
  std::vector<float> logits;        // (N, E) clean logits l
  std::vector<float> noise_logits;  // (N, E) x·Wnᵀ (noisy_topk)
  std::vector<float> eps;           // (N, E) ε (noisy_topk while training)
  // (N, E) the scores the policy weighs with: softmax(l), softmax(H) for noisy_topk, σ(l) for
  // sigmoid_bias. The aux loss reads these.
  std::vector<float> probs;
  std::vector<float> lse;                     // (N) logsumexp of the clean logits (z-loss)
  std::vector<float> dlogits, dnoise_logits;  // (N, E) scratch for backward
};

// Routes N tokens and fills `r` with nothing dropped yet (expert == selected) and `cache`.
// For expert choice the per-expert token count is expert_capacity(N, K, E, cf or 1).
// inp (N, C), gate (E, C), noise (E, C) noisy_topk only, bias (E) sigmoid_bias only.
void router_forward(Routing& r, RouterCache& cache, const float* inp, int64_t N,
                    const MoeConfig& cfg, const float* gate, const float* noise, const float* bias,
                    const MoeStep& step);

// router_forward in two stages, for an engine that computes the logit GEMMs itself (the CUDA
// backend): router_logits_resize sizes cache.logits (N, E) (and cache.noise_logits for
// noisy_topk) for the caller to fill with inp·gateᵀ (and inp·noiseᵀ); router_select then does
// everything after the GEMMs (skew, noise, scores, group limit, top-K, weights) exactly as
// router_forward does.
void router_logits_resize(RouterCache& cache, int64_t N, const MoeConfig& cfg);
void router_select(Routing& r, RouterCache& cache, int64_t N, const MoeConfig& cfg,
                   const float* bias, const MoeStep& step);

// key (N, E) = what the token-choice top-K ranked experts by: l for topk_softmax, H for
// noisy_topk, s + b for sigmoid_bias; −inf outside a token's kept groups under group-limited
// routing. From the cache of the last router_select; the order reroute_overflow offers experts in.
void router_selection_keys(float* key, const RouterCache& cache, int64_t N, const MoeConfig& cfg,
                           const float* bias);

// Gradients that reach the router from the rest of the layer.
struct RouterGrads {
  const float* dweight = nullptr;  // (N, S) on Routing::weight; 0 on dropped and empty slots
  const float* dprobs = nullptr;   // (N, E) on RouterCache::probs, or null
  const float* dlogits = nullptr;  // (N, E) straight onto the clean logits, or null
};

// dinp (N, C) += (dinp may be null), dgate (E, C) +=, dnoise (E, C) += (noisy_topk while
// training). inp, gate, noise as in the forward.
// Each slot's weight is differentiated as the router's weight of weight_expert(r, slot).
void router_backward(float* dinp, float* dgate, float* dnoise, const RouterGrads& grads,
                     const float* inp, const float* gate, const float* noise, const Routing& r,
                     RouterCache& cache, const MoeConfig& cfg);

// router_backward's first stage: cache.dlogits (N, E) (and cache.dnoise_logits when noisy) from
// the gradients reaching the router; the caller then computes the GEMMs dinp += dl·gate (+ dnl·
// noise), dgate += dlᵀ·inp, dnoise += dnlᵀ·inp.
void router_logit_grads(const RouterGrads& grads, const Routing& r, RouterCache& cache,
                        const MoeConfig& cfg);

// Indices of the K largest of key[0..E), largest first, ties to the lower index. vals is
// scratch of K floats.
void topk_indices(int32_t* idx, float* vals, const float* key, int64_t E, int64_t K);

}  // namespace moetrain
