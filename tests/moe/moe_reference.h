// A naive double-precision MoE layer that loops token by token, with its own routing, for the
// MoE tests. Shares nothing with src/moe except the config structs and the noise RNG.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/rng.h"
#include "moe/config.h"

namespace moetrain::testing {

struct MoeReference {
  std::vector<double> out;                 // (N, C)
  std::vector<int64_t> tokens_per_expert;  // (E) after dropping
  int64_t assignments = 0, dropped = 0;
  int64_t capacity = 0;
  double aux = 0, z = 0;
};

// y (C) = W2 · (silu(W1·x) ⊙ (W3·x)), w1/w3 (F, C), w2 (C, F)
inline void ref_swiglu_expert(const float* w1, const float* w3, const float* w2, const float* x,
                              int64_t C, int64_t F, std::vector<double>& y) {
  std::vector<double> h(F);
  for (int64_t f = 0; f < F; ++f) {
    double a = 0, b = 0;
    for (int64_t c = 0; c < C; ++c) {
      a += double(w1[f * C + c]) * x[c];
      b += double(w3[f * C + c]) * x[c];
    }
    h[f] = a / (1.0 + std::exp(-a)) * b;
  }
  y.assign(C, 0.0);
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t f = 0; f < F; ++f) y[c] += double(w2[c * F + f]) * h[f];
  }
}

// The K best of key (descending), ties to the lower index.
inline std::vector<int> ref_topk(const std::vector<double>& key, int64_t K) {
  std::vector<int> idx(key.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return key[a] > key[b]; });
  idx.resize(K);
  return idx;
}

inline MoeReference moe_reference(const MoeConfig& cfg, const float* inp, int64_t N,
                                  const MoeWeights& w, const float* bias, const MoeStep& step) {
  const int64_t C = cfg.C, E = cfg.E, K = cfg.K, F = cfg.F;
  MoeReference ref;
  ref.out.assign(N * C, 0.0);
  ref.tokens_per_expert.assign(E, 0);
  struct Assignment {
    int64_t token;
    int expert;
    double weight;
    bool kept = true;
  };
  std::vector<Assignment> as;
  std::vector<double> P(E, 0.0), probs(N * E);
  std::vector<int64_t> chosen(E, 0);
  Rng rng(step.seed, rng_stream(RngPurpose::RouterNoise, step.step, step.layer));
  for (int64_t t = 0; t < N; ++t) {
    const float* x = inp + t * C;
    std::vector<double> l(E, 0.0);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t c = 0; c < C; ++c) l[e] += double(w.gate[e * C + c]) * x[c];
    }
    double m = *std::max_element(l.begin(), l.end()), s = 0;
    for (double v : l) s += std::exp(v - m);
    double lse = m + std::log(s);
    ref.z += lse * lse;
    std::vector<double> p(E);
    for (int64_t e = 0; e < E; ++e) p[e] = std::exp(l[e] - lse);
    std::vector<int> top;
    std::vector<double> wt;
    switch (cfg.router) {
      case RouterKind::TopKSoftmax: {
        top = ref_topk(l, K);
        double sum = 0;
        for (int e : top) sum += p[e];
        for (int e : top) wt.push_back(cfg.renormalize ? p[e] / sum : p[e]);
        break;
      }
      case RouterKind::NoisyTopK: {
        std::vector<double> H = l;
        if (step.training) {
          for (int64_t e = 0; e < E; ++e) {
            double nl = 0;
            for (int64_t c = 0; c < C; ++c) nl += double(w.noise[e * C + c]) * x[c];
            H[e] += std::log1p(std::exp(nl)) * double(rng.normal(t * E + e));
          }
        }
        top = ref_topk(H, K);
        double hm = *std::max_element(H.begin(), H.end()), hs = 0, ks = 0;
        for (double v : H) hs += std::exp(v - hm);
        for (int64_t e = 0; e < E; ++e) p[e] = std::exp(H[e] - hm) / hs;
        for (int e : top) ks += std::exp(H[e] - hm);
        for (int e : top) wt.push_back(std::exp(H[e] - hm) / ks);
        break;
      }
      case RouterKind::SigmoidBias: {
        std::vector<double> sg(E), key(E);
        for (int64_t e = 0; e < E; ++e)
          sg[e] = 1.0 / (1.0 + std::exp(-l[e])), key[e] = sg[e] + bias[e];
        top = ref_topk(key, K);
        double sum = 0;
        for (int e : top) sum += sg[e];
        for (int e : top) wt.push_back(cfg.renormalize ? sg[e] / sum : sg[e]);
        break;
      }
      case RouterKind::ExpertChoice:
        break;
    }
    for (int64_t e = 0; e < E; ++e) P[e] += p[e], probs[t * E + e] = p[e];
    for (size_t k = 0; k < top.size(); ++k) as.push_back({t, top[k], wt[k]}), ++chosen[top[k]];
  }
  if (cfg.router == RouterKind::ExpertChoice) {
    double cf = cfg.capacity_factor > 0 ? cfg.capacity_factor : 1.0;
    ref.capacity = std::min<int64_t>(N, static_cast<int64_t>(std::ceil(double(N) * K / E * cf)));
    for (int64_t e = 0; e < E; ++e) {
      std::vector<double> col(N);
      for (int64_t t = 0; t < N; ++t) col[t] = probs[t * E + e];
      std::vector<int> toks = ref_topk(col, ref.capacity);
      for (int t : toks) as.push_back({t, int(e), col[t]});
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
                       [&](size_t a, size_t b) { return as[a].weight > as[b].weight; });
      for (size_t j = ref.capacity; j < mine.size(); ++j) as[mine[j]].kept = false, ++ref.dropped;
    }
  }
  ref.assignments = static_cast<int64_t>(as.size());
  std::vector<double> y;
  for (const Assignment& a : as) {
    if (!a.kept) continue;
    ++ref.tokens_per_expert[a.expert];
    int64_t off = a.expert * F * C;
    ref_swiglu_expert(w.w1 + off, w.w3 + off, w.w2 + off, inp + a.token * C, C, F, y);
    for (int64_t c = 0; c < C; ++c) ref.out[a.token * C + c] += a.weight * y[c];
  }
  if (cfg.shared_F > 0) {
    for (int64_t t = 0; t < N; ++t) {
      ref_swiglu_expert(w.shared_w1, w.shared_w3, w.shared_w2, inp + t * C, C, cfg.shared_F, y);
      for (int64_t c = 0; c < C; ++c) ref.out[t * C + c] += y[c];
    }
  }
  if (N > 0) {
    ref.z /= double(N);
    if (cfg.router == RouterKind::TopKSoftmax || cfg.router == RouterKind::NoisyTopK) {
      for (int64_t e = 0; e < E; ++e)
        ref.aux += double(chosen[e]) / double(N * K) * (P[e] / double(N));
      ref.aux *= double(E);
    }
  }
  return ref;
}

}  // namespace moetrain::testing
