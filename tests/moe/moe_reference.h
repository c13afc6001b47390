// A naive double-precision MoE layer that loops token by token, with its own routing, for the
// MoE tests. Shares nothing with src/moe except the config structs and the noise RNG.
// Each result carries the bound of a float layer's evaluation in any summation order
// (support/error_bound.h), so that the layer is checked alike on every instruction set.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "core/rng.h"
#include "moe/config.h"
#include "support/error_bound.h"

namespace moetrain::testing {

struct MoeReference {
  std::vector<Bounded> out;                // (N, C)
  std::vector<int64_t> tokens_per_expert;  // (E) after dropping
  int64_t assignments = 0, dropped = 0;
  int64_t capacity = 0;
  Bounded aux, z;  // bounds for the layer's float aux_loss() and z_loss()
};

// |silu'| ≤ 1.0998 (at x ≈ 2.4) and |silu''| ≤ 1/2 (at 0): they carry an error of a through
// silu and silu'.
inline constexpr double kSiluSlope = 1.1;
inline constexpr double kSiluCurvature = 0.5;

// silu(a)·b as the kernels evaluate it, a·σ(a)·b with σ(a) = 1/(1 + e^-a), from computed a and
// b: their errors carried through, plus the evaluation's own (expf, an add, a divide, two
// multiplies). The smallest normal covers e^-a overflowing, which makes σ and the result 0.
inline Bounded swiglu_bounded(Bounded a, Bounded b) {
  const double silu = a.v / (1.0 + std::exp(-a.v));
  const double carried = kSiluSlope * a.e * b.mag() + std::abs(silu) * b.e;
  const double own = gamma_n(kLibmUnits + 4) * (std::abs(silu) + kSiluSlope * a.e) * b.mag();
  return {silu * b.v, carried + own + kF32MinNormal};
}

// y (C) = W2 · (silu(W1·x) ⊙ (W3·x)), w1/w3 (F, C), w2 (C, F)
inline void ref_swiglu_expert(const float* w1, const float* w3, const float* w2, const Bounded* x,
                              int64_t C, int64_t F, std::vector<Bounded>& y) {
  std::vector<Bounded> h(F);
  for (int64_t f = 0; f < F; ++f) {
    BoundedSum a, b;
    for (int64_t c = 0; c < C; ++c) {
      a.add(Bounded{w1[f * C + c]}, x[c]);
      b.add(Bounded{w3[f * C + c]}, x[c]);
    }
    h[f] = swiglu_bounded(a.result(), b.result());
  }
  y.assign(C, Bounded{});
  for (int64_t c = 0; c < C; ++c) {
    BoundedSum s;
    for (int64_t f = 0; f < F; ++f) s.add(Bounded{w2[c * F + f]}, h[f]);
    y[c] = s.result();
  }
}

// Relative errors of the router's float evaluation of one token's softmax, whose logits (or
// noisy logits) span `spread`: the largest |l − max l| that goes into an exp.
struct RouterRounding {
  double exp_term;  // one e^(l − m): the rounded subtraction, then expf
  double sum;       // Σ_E of those terms
  double softmax;   // one softmax probability: its term over the sum, then the multiply
};
inline RouterRounding router_rounding(double spread, int64_t E) {
  RouterRounding r;
  r.exp_term = std::expm1(kUnitF32 * spread) + gamma_n(kLibmUnits) * (1 + kUnitF32 * spread);
  r.sum = r.exp_term + gamma_n(E) * (1 + r.exp_term);
  r.softmax = (r.exp_term + r.sum + gamma_n(2)) * (1 + r.sum);
  return r;
}
// (1 + a)(1 + b) − 1
inline double compose(double a, double b) {
  return a + b + a * b;
}

// The K best of key (descending), ties to the lower index.
inline std::vector<int> ref_topk(const std::vector<double>& key, int64_t K) {
  std::vector<int> idx(key.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return key[a] > key[b]; });
  idx.resize(K);
  return idx;
}

// Group-limited routing: key[e] = -inf for the experts outside the best route_group_topk groups,
// a group ranked by the sum of its top-min(K, E/G) scores. Nothing changes when it is off.
inline void ref_mask_groups(std::vector<double>& key, const std::vector<double>& score,
                            const MoeConfig& cfg) {
  if (!cfg.group_limited()) return;
  const int64_t G = cfg.route_groups, Eg = cfg.E / G, J = std::min(cfg.K, Eg);
  std::vector<double> group_score(G);
  for (int64_t g = 0; g < G; ++g) {
    std::vector<double> part(score.begin() + g * Eg, score.begin() + (g + 1) * Eg);
    std::sort(part.begin(), part.end(), std::greater<>());
    for (int64_t j = 0; j < J; ++j) group_score[g] += part[j];
  }
  std::vector<bool> kept(G, false);
  for (int g : ref_topk(group_score, cfg.route_group_topk)) kept[g] = true;
  for (int64_t e = 0; e < cfg.E; ++e) {
    if (!kept[e / Eg]) key[e] = -std::numeric_limits<double>::infinity();
  }
}

// inp_err (N, C), if given: how far the layer's input may lie from inp (the reference of a whole
// model hands its own float stream in, which differs from the model's by that much).
inline MoeReference moe_reference(const MoeConfig& cfg, const float* inp, int64_t N,
                                  const MoeWeights& w, const float* bias, const MoeStep& step,
                                  const double* inp_err = nullptr) {
  const int64_t C = cfg.C, E = cfg.E, K = cfg.K, F = cfg.F;
  MoeReference ref;
  ref.tokens_per_expert.assign(E, 0);
  struct Assignment {
    int64_t token;
    int expert;
    Bounded weight;
    bool kept = true;
  };
  std::vector<Assignment> as;
  // P: Σ_t probabilities per expert, dP: its bound; probs and their relative bounds (N, E).
  std::vector<double> P(E, 0.0), dP(E, 0.0), probs(N * E), probs_rel(N * E);
  std::vector<int64_t> chosen(E, 0);
  std::vector<Bounded> x_all(N * C);
  for (int64_t i = 0; i < N * C; ++i) x_all[i] = {inp[i], inp_err ? inp_err[i] : 0.0};
  double z = 0, z_err = 0;
  Rng rng(step.seed, rng_stream(RngPurpose::RouterNoise, step.step, step.layer));
  for (int64_t t = 0; t < N; ++t) {
    const Bounded* x = x_all.data() + t * C;
    // Logits, each within dl_e[e] of what the layer computes: |Δ lse| ≤ max_e Δl_e, and
    // |Δ log softmax_e| ≤ 2·max_e Δl_e.
    std::vector<double> l(E), dl_e(E);
    for (int64_t e = 0; e < E; ++e) {
      BoundedSum s;
      for (int64_t c = 0; c < C; ++c) s.add(Bounded{w.gate[e * C + c]}, x[c]);
      l[e] = s.result().v, dl_e[e] = s.result().e;
    }
    const double dl = *std::max_element(dl_e.begin(), dl_e.end());
    const auto [lmin, lmax] = std::minmax_element(l.begin(), l.end());
    const RouterRounding rr = router_rounding(*lmax - *lmin + 2 * dl, E);
    double m = *lmax, s = 0;
    for (double v : l) s += std::exp(v - m);
    const double lse = m + std::log(s);
    // lse = m + log(Σ e^(l − m)) in float: the sum's relative error through the log, logf's own,
    // and the final add.
    double lse_err = dl - std::log1p(-rr.sum) + gamma_n(kLibmUnits) * (std::log(s) + rr.sum);
    lse_err += gamma_n(1) * (std::abs(lse) + lse_err);
    z += lse * lse;
    z_err += (2 * std::abs(lse) + lse_err) * lse_err;
    std::vector<double> p(E);
    for (int64_t e = 0; e < E; ++e) p[e] = std::exp(l[e] - lse);
    double p_rel = compose(std::expm1(2 * dl), rr.softmax);
    std::vector<int> top;
    std::vector<double> wt;
    double w_rel = 0;  // relative bound of the kept weights
    switch (cfg.router) {
      case RouterKind::TopKSoftmax: {
        std::vector<double> key = l;
        ref_mask_groups(key, p, cfg);
        top = ref_topk(key, K);
        double sum = 0;
        for (int e : top) sum += p[e];
        for (int e : top) wt.push_back(cfg.renormalize ? p[e] / sum : p[e]);
        // Renormalised: e^(l_k) / Σ_kept e^(l_j), still within 2·Δl in log; the float sum over
        // the kept probabilities, the reciprocal and the multiply add their rounding.
        w_rel = cfg.renormalize
                    ? compose(std::expm1(2 * dl), compose(2 * rr.softmax, gamma_n(K + 1)))
                    : p_rel;
        break;
      }
      case RouterKind::NoisyTopK: {
        std::vector<Bounded> H(E);
        for (int64_t e = 0; e < E; ++e) H[e] = {l[e], dl_e[e]};
        if (step.training) {
          for (int64_t e = 0; e < E; ++e) {
            BoundedSum nl;
            for (int64_t c = 0; c < C; ++c) nl.add(Bounded{w.noise[e * C + c]}, x[c]);
            const Bounded n = nl.result();
            // softplus = log1p(e^x) is 1-Lipschitz; expf and log1pf each add their error, and
            // the kernel's cut-over to x above 20 drops at most e^-20.
            Bounded sp = apply(n, std::log1p(std::exp(n.v)), 1.0, 2 * gamma_n(kLibmUnits));
            if (n.v + n.e > 20) sp.e += std::exp(-20.0);
            BoundedSum h;
            h.add(H[e]);
            h.add(sp, Bounded{double(rng.normal(t * E + e))});
            H[e] = h.result();
          }
        }
        std::vector<double> Hv(E);
        double dH = 0;
        for (int64_t e = 0; e < E; ++e) Hv[e] = H[e].v, dH = std::max(dH, H[e].e);
        const auto [hmin, hmax] = std::minmax_element(Hv.begin(), Hv.end());
        const RouterRounding rh = router_rounding(*hmax - *hmin + 2 * dH, E);
        double hm = *hmax, hs = 0, ks = 0;
        for (double v : Hv) hs += std::exp(v - hm);
        for (int64_t e = 0; e < E; ++e) p[e] = std::exp(Hv[e] - hm) / hs;
        std::vector<double> key = Hv;
        ref_mask_groups(key, p, cfg);
        top = ref_topk(key, K);
        for (int e : top) ks += std::exp(Hv[e] - hm);
        for (int e : top) wt.push_back(std::exp(Hv[e] - hm) / ks);
        p_rel = compose(std::expm1(2 * dH), rh.softmax);
        w_rel = compose(std::expm1(2 * dH), compose(2 * rh.softmax, gamma_n(K + 1)));
        break;
      }
      case RouterKind::SigmoidBias: {
        std::vector<double> sg(E), key(E);
        for (int64_t e = 0; e < E; ++e)
          sg[e] = 1.0 / (1.0 + std::exp(-l[e])), key[e] = sg[e] + bias[e];
        ref_mask_groups(key, std::vector<double>(key), cfg);
        top = ref_topk(key, K);
        double sum = 0;
        for (int e : top) sum += sg[e];
        for (int e : top) wt.push_back(cfg.renormalize ? sg[e] / sum : sg[e]);
        // |Δ log σ(l)| = (1 − σ)·|Δl| ≤ Δl; σ in float: expf, an add and a divide.
        const double sig_rel = gamma_n(kLibmUnits + 2);
        w_rel = cfg.renormalize ? compose(std::expm1(2 * dl), compose(2 * sig_rel, gamma_n(K + 1)))
                                : compose(std::expm1(dl), sig_rel);
        break;
      }
      case RouterKind::ExpertChoice:
        break;
    }
    for (int64_t e = 0; e < E; ++e) {
      P[e] += p[e], dP[e] += p_rel * p[e];
      probs[t * E + e] = p[e], probs_rel[t * E + e] = p_rel;
    }
    for (size_t k = 0; k < top.size(); ++k) {
      as.push_back({t, top[k], {wt[k], w_rel * wt[k]}});
      ++chosen[top[k]];
    }
  }
  if (cfg.router == RouterKind::ExpertChoice) {
    double cf = cfg.capacity_factor > 0 ? cfg.capacity_factor : 1.0;
    ref.capacity = std::min<int64_t>(N, static_cast<int64_t>(std::ceil(double(N) * K / E * cf)));
    for (int64_t e = 0; e < E; ++e) {
      std::vector<double> col(N);
      for (int64_t t = 0; t < N; ++t) col[t] = probs[t * E + e];
      std::vector<int> toks = ref_topk(col, ref.capacity);
      for (int t : toks) as.push_back({t, int(e), {col[t], probs_rel[t * E + e] * col[t]}});
    }
    // Token by token, experts ascending: the slot order of the layer.
    std::stable_sort(as.begin(), as.end(), [](const Assignment& a, const Assignment& b) {
      return a.token < b.token || (a.token == b.token && a.expert < b.expert);
    });
  } else if (cfg.capacity_factor > 0) {
    ref.capacity = std::min<int64_t>(
        N, static_cast<int64_t>(std::ceil(double(N) * K / E * cfg.capacity_factor)));
    for (int64_t e = 0; e < E; ++e) {
      std::vector<size_t> mine;
      for (size_t i = 0; i < as.size(); ++i) {
        if (as[i].expert == e) mine.push_back(i);
      }
      // Assignments are stored in token order, so stable sorting by weight breaks ties by token.
      std::stable_sort(mine.begin(), mine.end(),
                       [&](size_t a, size_t b) { return as[a].weight.v > as[b].weight.v; });
      for (size_t j = ref.capacity; j < mine.size(); ++j) as[mine[j]].kept = false, ++ref.dropped;
    }
  }
  ref.assignments = static_cast<int64_t>(as.size());
  // out = shared expert + Σ_kept weight · expert output, one float sum per element.
  std::vector<BoundedSum> out(N * C);
  std::vector<Bounded> y;
  if (cfg.shared_F > 0) {
    for (int64_t t = 0; t < N; ++t) {
      ref_swiglu_expert(w.shared_w1, w.shared_w3, w.shared_w2, x_all.data() + t * C, C,
                        cfg.shared_F, y);
      for (int64_t c = 0; c < C; ++c) out[t * C + c].add(y[c]);
    }
  }
  for (const Assignment& a : as) {
    if (!a.kept) continue;
    ++ref.tokens_per_expert[a.expert];
    int64_t off = a.expert * F * C;
    ref_swiglu_expert(w.w1 + off, w.w3 + off, w.w2 + off, x_all.data() + a.token * C, C, F, y);
    for (int64_t c = 0; c < C; ++c) out[a.token * C + c].add(a.weight, y[c]);
  }
  ref.out.resize(N * C);
  for (int64_t i = 0; i < N * C; ++i) ref.out[i] = out[i].result();
  // The losses are summed in double from the float probabilities and lse, then rounded to float.
  if (N > 0) {
    ref.z = {z / double(N), z_err / double(N)};
    ref.z.e += gamma_n(1) * ref.z.mag();
    if (cfg.router == RouterKind::TopKSoftmax || cfg.router == RouterKind::NoisyTopK) {
      for (int64_t e = 0; e < E; ++e) {
        const double f = double(chosen[e]) / double(N * K);
        ref.aux.v += f * (P[e] / double(N)), ref.aux.e += f * (dP[e] / double(N));
      }
      ref.aux.v *= double(E), ref.aux.e *= double(E);
      ref.aux.e += gamma_n(1) * ref.aux.mag();
    }
  }
  return ref;
}

}  // namespace moetrain::testing
