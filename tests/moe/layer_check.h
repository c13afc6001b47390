// A MoE layer with random parameters and data, and finite differences through it that skip the
// entries whose perturbation changes the routing: the gradient checks of the MoE layer tests.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moe/moe_layer.h"
#include "support/gradcheck.h"

namespace moetrain::testing {

// A layer's parameters, gradients and data, all random.
struct LayerData {
  MoeConfig cfg;
  int64_t N = 0;
  std::vector<float> params, grads, inp, R;
  MoeWeights w, g;

  LayerData(const MoeConfig& c, int64_t n, uint64_t seed) : cfg(c), N(n) {
    MoeParamSizes s = moe_param_sizes(cfg);
    params.assign(s.total(), 0.0f);
    grads.assign(s.total(), 0.0f);
    w = moe_weights_from_buffer(cfg, params.data());
    g = moe_weights_from_buffer(cfg, grads.data());
    auto fill = [&](float* p, int64_t count, uint64_t sd, float stddev) {
      auto v = random_vector(count, sd, stddev);
      std::copy(v.begin(), v.end(), p);
    };
    fill(w.gate, s.gate, seed + 1, 1.0f);
    if (s.noise) fill(w.noise, s.noise, seed + 2, 0.7f);
    fill(w.w1, s.w1, seed + 3, 0.5f);
    fill(w.w3, s.w3, seed + 4, 0.5f);
    fill(w.w2, s.w2, seed + 5, 0.5f);
    if (s.shared_w1) {
      fill(w.shared_w1, s.shared_w1, seed + 6, 0.5f);
      fill(w.shared_w3, s.shared_w3, seed + 7, 0.5f);
      fill(w.shared_w2, s.shared_w2, seed + 8, 0.5f);
    }
    inp = random_vector(N * cfg.C, seed + 9);
    R = random_vector(N * cfg.C, seed + 10);
  }
  // sum(out ⊙ R) + aux_coef·L_aux + z_coef·L_z, from a fresh forward.
  double loss(MoeLayer& layer, const MoeStep& step, std::vector<float>* out_copy = nullptr) {
    std::vector<float> out(N * cfg.C);
    layer.forward(out.data(), inp.data(), N, w, step);
    double s = 0;
    for (int64_t i = 0; i < N * cfg.C; ++i) s += double(out[i]) * R[i];
    if (out_copy) *out_copy = out;
    return s + double(cfg.aux_loss_coef) * layer.aux_loss() +
           double(cfg.z_loss_coef) * layer.z_loss();
  }
};

// Central differences that skip an entry whose ±h perturbation changes the routing (a flip makes
// the loss discontinuous there). Requires most entries to be checked.
inline void check_gradient_routed(float* param, const float* analytic, int64_t n,
                                  const std::function<double()>& loss,
                                  const std::function<bool()>& same_routing,
                                  const std::string& what, int64_t max_checks = 40,
                                  double h = 1e-2) {
  int64_t step = n <= max_checks ? 1 : n / max_checks;
  int64_t tried = 0, checked = 0;
  double worst = 0, worst_num = 0;
  int64_t at = -1;
  for (int64_t i = 0; i < n; i += step) {
    ++tried;
    float saved = param[i];
    param[i] = saved + static_cast<float>(h);
    double lp = loss();
    bool ok = same_routing();
    param[i] = saved - static_cast<float>(h);
    double lm = loss();
    ok = ok && same_routing();
    param[i] = saved;
    if (!ok) continue;
    ++checked;
    double num = (lp - lm) / (2 * h);
    double err = std::abs(num - analytic[i]) / (2e-3 + 2e-2 * std::abs(num));
    if (!(err <= worst)) worst = err, at = i, worst_num = num;
  }
  EXPECT_GE(2 * checked, tried) << what << ": only " << checked << " of " << tried
                                << " entries kept their routing";
  EXPECT_LE(worst, 1.0) << what << ": element " << at << " analytic "
                        << (at >= 0 ? analytic[at] : 0) << " numeric " << worst_num;
}

}  // namespace moetrain::testing
