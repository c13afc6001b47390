#include "moe/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/check.h"
#include "core/profile.h"
#include "core/rng.h"
#include "kernels/det_gemm.h"

namespace moetrain {

namespace {

constexpr int64_t kParallelRows = 64;

inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}
inline float softplus(float x) {
  return x > 20.0f ? x : std::log1p(std::exp(x));
}

// p (E) = softmax(l); returns logsumexp(l). p may alias l.
float softmax_row(float* p, const float* l, int64_t E) {
  float m = l[0];
  for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) {
    p[e] = std::exp(l[e] - m);
    sum += p[e];
  }
  float inv = 1.0f / sum;
  for (int64_t e = 0; e < E; ++e) p[e] *= inv;
  return m + std::log(sum);
}

float logsumexp_row(const float* l, int64_t E) {
  float m = l[0];
  for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(l[e] - m);
  return m + std::log(sum);
}

// w_k = score[idx_k] (/ Σ_k score[idx_k] when normalising).
void kept_weights(float* w, const int32_t* idx, const float* score, int64_t K, bool normalize) {
  float sum = 0.0f;
  for (int64_t k = 0; k < K; ++k) sum += score[idx[k]];
  float inv = normalize ? 1.0f / sum : 1.0f;
  for (int64_t k = 0; k < K; ++k) w[k] = score[idx[k]] * inv;
}

// Expert e keeps its top-Cap tokens by p[:, e] (ties to the lower token index).
void expert_choice_select(Routing& r, const float* probs, int64_t N, int64_t E, int64_t cap) {
  std::fill(r.selected.begin(), r.selected.end(), -1);
  std::fill(r.weight.begin(), r.weight.end(), 0.0f);
  if (cap == 0) return;
#pragma omp parallel if (N > kParallelRows)
  {
    std::vector<int32_t> order(N);
#pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; ++e) {
      std::iota(order.begin(), order.end(), 0);
      auto before = [&](int32_t a, int32_t b) {
        float pa = probs[a * E + e], pb = probs[b * E + e];
        return pa > pb || (pa == pb && a < b);
      };
      std::partial_sort(order.begin(), order.begin() + cap, order.end(), before);
      for (int64_t i = 0; i < cap; ++i) {
        int64_t t = order[i];
        r.selected[t * E + e] = static_cast<int32_t>(e);
        r.weight[t * E + e] = probs[t * E + e];
      }
    }
  }
}

// Per-thread scratch of keep_best_groups.
struct GroupScratch {
  std::vector<float> vals, gscore, gvals;
  std::vector<int32_t> idx, gidx;
  std::vector<char> kept;
  explicit GroupScratch(const MoeConfig& cfg) {
    const int64_t G = std::max<int64_t>(cfg.route_groups, 1);
    const int64_t J = std::min(cfg.K, cfg.E / G), M = std::max<int64_t>(cfg.route_group_topk, 1);
    vals.resize(J), idx.resize(J);
    gscore.resize(G), kept.resize(G);
    gvals.resize(M), gidx.resize(M);
  }
};

// Group-limited routing: key[e] = -inf for the experts outside the token's best M groups, a group
// ranked by the sum of its J = min(K, E/G) largest scores (ties to the lower group). J = K because
// no token can take more than K experts of one group, so the sum is the most that group could add
// to the token's top-K. score may alias key: every group is scored before anything is masked.
void keep_best_groups(float* key, const float* score, const MoeConfig& cfg, GroupScratch& s) {
  const int64_t G = cfg.route_groups, M = cfg.route_group_topk, Eg = cfg.E / G;
  const int64_t J = std::min(cfg.K, Eg);
  for (int64_t g = 0; g < G; ++g) {
    topk_indices(s.idx.data(), s.vals.data(), score + g * Eg, Eg, J);
    float sum = 0.0f;
    for (int64_t j = 0; j < J; ++j) sum += s.vals[j];
    s.gscore[g] = sum;
  }
  topk_indices(s.gidx.data(), s.gvals.data(), s.gscore.data(), G, M);
  std::fill(s.kept.begin(), s.kept.end(), 0);
  for (int64_t m = 0; m < M; ++m) s.kept[s.gidx[m]] = 1;
  for (int64_t g = 0; g < G; ++g) {
    if (s.kept[g]) continue;
    std::fill(key + g * Eg, key + (g + 1) * Eg, -std::numeric_limits<float>::infinity());
  }
}

}  // namespace

void topk_indices(int32_t* idx, float* vals, const float* key, int64_t E, int64_t K) {
  int64_t n = 0;
  for (int64_t e = 0; e < E; ++e) {
    float v = key[e];
    int64_t pos;
    if (n < K) {
      pos = n++;
    } else if (v > vals[K - 1]) {
      pos = K - 1;
    } else {
      continue;
    }
    while (pos > 0 && vals[pos - 1] < v) {
      vals[pos] = vals[pos - 1];
      idx[pos] = idx[pos - 1];
      --pos;
    }
    vals[pos] = v;
    idx[pos] = static_cast<int32_t>(e);
  }
}

void router_forward(Routing& r, RouterCache& cache, const float* inp, int64_t N,
                    const MoeConfig& cfg, const float* gate, const float* noise, const float* bias,
                    const MoeStep& step) {
  MOETRAIN_CHECK(N >= 0, "router_forward: N is {}, must be >= 0", N);
  MOETRAIN_CHECK(N == 0 || (inp && gate), "router_forward: null input or gate weights for N={}", N);
  MOETRAIN_CHECK(cfg.router != RouterKind::NoisyTopK || N == 0 || noise,
                 "router_forward: noisy_topk needs noise weights");
  {
    PhaseScope phase_scope(Phase::Router);
    const int64_t C = cfg.C, E = cfg.E;
    router_logits_resize(cache, N, cfg);
    if (N > 0) {
      grouped_gemm_det(Trans::T, 1, &N, E, C, inp, gate, 0, cache.logits.data(), false);
      if (cfg.router == RouterKind::NoisyTopK)
        grouped_gemm_det(Trans::T, 1, &N, E, C, inp, noise, 0, cache.noise_logits.data(), false);
    }
  }
  router_select(r, cache, N, cfg, bias, step);
}

void router_logits_resize(RouterCache& cache, int64_t N, const MoeConfig& cfg) {
  cache.N = N;
  cache.logits.resize(N * cfg.E);
  if (cfg.router == RouterKind::NoisyTopK) cache.noise_logits.resize(N * cfg.E);
}

void router_select(Routing& r, RouterCache& cache, int64_t N, const MoeConfig& cfg,
                   const float* bias, const MoeStep& step) {
  PhaseScope phase_scope(Phase::Router);
  const int64_t E = cfg.E, K = cfg.K;
  const RouterKind kind = cfg.router;
  MOETRAIN_CHECK(cache.N == N && static_cast<int64_t>(cache.logits.size()) == N * E,
                 "router_select: the cache holds logits for N={}, routing N={}", cache.N, N);
  MOETRAIN_CHECK(kind != RouterKind::SigmoidBias || bias,
                 "router_forward: sigmoid_bias needs the bias buffer");
  const int64_t S = is_token_choice(kind) ? K : E;
  r.N = N, r.E = E, r.S = S;
  r.selected.resize(N * S);
  r.weight.resize(N * S);
  cache.noisy = kind == RouterKind::NoisyTopK && step.training;
  cache.probs.resize(N * E);
  cache.lse.resize(N);
  if (N > 0) {
    if (cfg.router_skew > 0.0f) {
      std::vector<float> offset(E);
      for (int64_t e = 0; e < E; ++e)
        offset[e] = -cfg.router_skew * std::log(static_cast<float>(e + 1));
      for (int64_t t = 0; t < N; ++t)
        for (int64_t e = 0; e < E; ++e) cache.logits[t * E + e] += offset[e];
    }
    if (cache.noisy) {
      cache.eps.resize(N * E);
      Rng rng(step.seed, rng_stream(RngPurpose::RouterNoise, step.step, step.layer));
      rng_fill_normal(cache.eps.data(), N * E, rng, 0.0f, 1.0f,
                      step.token_offset * static_cast<uint64_t>(E));
    }
  }
  const bool renorm = cfg.renormalize;
  const bool grouped = cfg.group_limited();
  MOETRAIN_CHECK(!grouped || is_token_choice(kind),
                 "router_forward: model.route_groups = {} needs a token-choice router, not {}",
                 cfg.route_groups, router_kind_name(kind));
#pragma omp parallel if (N > kParallelRows)
  {
    std::vector<float> key(E), score(grouped ? E : 0), vals(K);
    GroupScratch groups(cfg);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N; ++t) {
      const float* l = cache.logits.data() + t * E;
      float* p = cache.probs.data() + t * E;
      int32_t* sel = r.selected.data() + t * S;
      float* w = r.weight.data() + t * S;
      switch (kind) {
        case RouterKind::TopKSoftmax:
          cache.lse[t] = softmax_row(p, l, E);
          if (grouped) {
            std::copy(l, l + E, key.data());
            keep_best_groups(key.data(), p, cfg, groups);
          }
          topk_indices(sel, vals.data(), grouped ? key.data() : l, E, K);
          kept_weights(w, sel, p, K, renorm);
          break;
        case RouterKind::NoisyTopK: {
          cache.lse[t] = logsumexp_row(l, E);
          if (cache.noisy) {
            const float* nl = cache.noise_logits.data() + t * E;
            const float* eps = cache.eps.data() + t * E;
            for (int64_t e = 0; e < E; ++e) p[e] = l[e] + softplus(nl[e]) * eps[e];
          } else {
            std::copy(l, l + E, p);
          }
          if (grouped) {
            // Groups are ranked by the noisy probabilities softmax(H), experts by H.
            softmax_row(score.data(), p, E);
            std::copy(p, p + E, key.data());
            keep_best_groups(key.data(), score.data(), cfg, groups);
          }
          topk_indices(sel, vals.data(), grouped ? key.data() : p, E, K);
          softmax_row(p, p, E);
          // Σ_kept p renormalised equals the softmax over the kept entries of H.
          kept_weights(w, sel, p, K, true);
          break;
        }
        case RouterKind::ExpertChoice:
          cache.lse[t] = softmax_row(p, l, E);
          break;
        case RouterKind::SigmoidBias:
          cache.lse[t] = logsumexp_row(l, E);
          for (int64_t e = 0; e < E; ++e) {
            p[e] = sigmoid(l[e]);
            key[e] = p[e] + bias[e];
          }
          // As in DeepSeek-V3, groups are ranked by the biased scores that select the experts.
          if (grouped) keep_best_groups(key.data(), key.data(), cfg, groups);
          topk_indices(sel, vals.data(), key.data(), E, K);
          kept_weights(w, sel, p, K, renorm);
          break;
      }
    }
  }
  if (kind == RouterKind::ExpertChoice) {
    float cf = cfg.capacity_factor > 0.0f ? cfg.capacity_factor : 1.0f;
    expert_choice_select(r, cache.probs.data(), N, E, expert_capacity(N, K, E, cf));
  }
  r.expert = r.selected;
}

void router_selection_keys(float* key, const RouterCache& cache, int64_t N, const MoeConfig& cfg,
                           const float* bias) {
  const int64_t E = cfg.E;
  const RouterKind kind = cfg.router;
  MOETRAIN_CHECK(is_token_choice(kind), "router_selection_keys: {} selects no top-K per token",
                 router_kind_name(kind));
  MOETRAIN_CHECK(cache.N == N, "router_selection_keys: the cache holds N={}, not {}", cache.N, N);
  MOETRAIN_CHECK(kind != RouterKind::SigmoidBias || bias,
                 "router_selection_keys: sigmoid_bias needs the bias buffer");
  const bool grouped = cfg.group_limited();
#pragma omp parallel if (N > kParallelRows)
  {
    GroupScratch groups(cfg);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N; ++t) {
      const float* l = cache.logits.data() + t * E;
      const float* p = cache.probs.data() + t * E;
      float* k = key + t * E;
      // The same expressions router_select ranks by, so the order is the top-K's own.
      switch (kind) {
        case RouterKind::TopKSoftmax:
          std::copy(l, l + E, k);
          break;
        case RouterKind::NoisyTopK:
          if (cache.noisy) {
            const float* nl = cache.noise_logits.data() + t * E;
            const float* eps = cache.eps.data() + t * E;
            for (int64_t e = 0; e < E; ++e) k[e] = l[e] + softplus(nl[e]) * eps[e];
          } else {
            std::copy(l, l + E, k);
          }
          break;
        case RouterKind::SigmoidBias:
          for (int64_t e = 0; e < E; ++e) k[e] = p[e] + bias[e];
          break;
        case RouterKind::ExpertChoice:
          break;
      }
      if (grouped) keep_best_groups(k, kind == RouterKind::SigmoidBias ? k : p, cfg, groups);
    }
  }
}

void router_logit_grads(const RouterGrads& grads, const Routing& r, RouterCache& cache,
                        const MoeConfig& cfg) {
  PhaseScope phase_scope(Phase::Router);
  const int64_t N = r.N, E = cfg.E, S = r.S;
  const RouterKind kind = cfg.router;
  MOETRAIN_CHECK(cache.N == N && r.E == E,
                 "router_backward: cache for N={} does not match routing N={}", cache.N, N);
  if (N == 0) return;
  MOETRAIN_CHECK(grads.dweight != nullptr, "router_backward: dweight is null");
  cache.dlogits.resize(N * E);
  if (cache.noisy) cache.dnoise_logits.resize(N * E);
  const bool renorm = kind == RouterKind::NoisyTopK || cfg.renormalize;
#pragma omp parallel if (N > kParallelRows)
  {
    std::vector<float> dp(E);
    std::vector<int32_t> we(S);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N; ++t) {
      const float* p = cache.probs.data() + t * E;
      // The experts whose scores the weights are (the router's choice unless rerouted).
      for (int64_t k = 0; k < S; ++k) we[k] = weight_expert(r, t * S + k);
      const int32_t* sel = we.data();
      const float* w = r.weight.data() + t * S;
      const float* dw = grads.dweight + t * S;
      float* dl = cache.dlogits.data() + t * E;
      for (int64_t e = 0; e < E; ++e) dp[e] = grads.dprobs ? grads.dprobs[t * E + e] : 0.0f;
      // Token choice with renormalisation: w is a softmax over the kept logits (or kept σ/Σσ),
      // whose gradient is local to the kept entries.
      float sw = 0.0f;
      if (is_token_choice(kind)) {
        for (int64_t k = 0; k < S; ++k) sw += w[k] * dw[k];
      }
      switch (kind) {
        case RouterKind::TopKSoftmax:
        case RouterKind::NoisyTopK:
        case RouterKind::ExpertChoice: {
          if (!renorm || kind == RouterKind::ExpertChoice) {
            for (int64_t k = 0; k < S; ++k) {
              if (sel[k] >= 0) dp[sel[k]] += dw[k];
            }
          }
          float dot = 0.0f;
          for (int64_t e = 0; e < E; ++e) dot += p[e] * dp[e];
          for (int64_t e = 0; e < E; ++e) dl[e] = p[e] * (dp[e] - dot);
          if (renorm && kind != RouterKind::ExpertChoice) {
            for (int64_t k = 0; k < S; ++k) dl[sel[k]] += w[k] * (dw[k] - sw);
          }
          break;
        }
        case RouterKind::SigmoidBias: {
          if (renorm) {
            float sum = 0.0f;
            for (int64_t k = 0; k < S; ++k) sum += p[sel[k]];
            for (int64_t k = 0; k < S; ++k) dp[sel[k]] += (dw[k] - sw) / sum;
          } else {
            for (int64_t k = 0; k < S; ++k) dp[sel[k]] += dw[k];
          }
          for (int64_t e = 0; e < E; ++e) dl[e] = dp[e] * p[e] * (1.0f - p[e]);
          break;
        }
      }
      // dl is ∂/∂H for noisy_topk; H = l + softplus(nl)·ε.
      if (cache.noisy) {
        const float* nl = cache.noise_logits.data() + t * E;
        const float* eps = cache.eps.data() + t * E;
        float* dnl = cache.dnoise_logits.data() + t * E;
        for (int64_t e = 0; e < E; ++e) dnl[e] = dl[e] * eps[e] * sigmoid(nl[e]);
      }
      if (grads.dlogits) {
        for (int64_t e = 0; e < E; ++e) dl[e] += grads.dlogits[t * E + e];
      }
    }
  }
}

void router_backward(float* dinp, float* dgate, float* dnoise, const RouterGrads& grads,
                     const float* inp, const float* gate, const float* noise, const Routing& r,
                     RouterCache& cache, const MoeConfig& cfg) {
  const int64_t N = r.N, C = cfg.C, E = cfg.E;
  if (N > 0) {
    MOETRAIN_CHECK(dgate != nullptr, "router_backward: dgate is null");
    MOETRAIN_CHECK(!cache.noisy || dnoise != nullptr,
                   "router_backward: noisy_topk needs a noise-weight gradient");
  }
  router_logit_grads(grads, r, cache, cfg);
  if (N == 0) return;
  PhaseScope phase_scope(Phase::Router);
  // dinp += dl · gate (+ dnl · noise);  dgate += dlᵀ · inp;  dnoise += dnlᵀ · inp
  const float* dl = cache.dlogits.data();
  const float* dnl = cache.dnoise_logits.data();
  if (dinp) {
    grouped_gemm_det(Trans::N, 1, &N, C, E, dl, gate, 0, dinp, true);
    if (cache.noisy) grouped_gemm_det(Trans::N, 1, &N, C, E, dnl, noise, 0, dinp, true);
  }
  const ReduceProblem problems[2] = {{E, C, dl, inp, dgate, 0, DType::F32},
                                     {E, C, dnl, inp, dnoise, 0, DType::F32}};
  grouped_gemm_reduce_det(1, &N, problems, cache.noisy ? 2 : 1, true);
}

}  // namespace moetrain
