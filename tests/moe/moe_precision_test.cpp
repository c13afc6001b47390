// The MoE layer in mixed precision: expert GEMMs on bf16 / fp16 operands with f32 accumulation,
// the router in f32. Compared with the f32 layer on the same weights and tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "moe/moe_layer.h"
#include "support/gradcheck.h"

using namespace moetrain;

namespace {

double rel_norm_error(const float* a, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

struct Run {
  std::vector<float> out, dinp, grads;
  std::vector<int32_t> selected;
};

// Forward and backward of one layer; lp = F32 runs the plain f32 layer.
Run run_layer(const MoeConfig& cfg, const std::vector<float>& params, const std::vector<float>& inp,
              const std::vector<float>& dout, int64_t N, DType lp) {
  std::vector<float> p = params;
  Run r;
  r.grads.assign(p.size(), 0.0f);
  MoeWeights w = moe_weights_from_buffer(cfg, p.data());
  MoeWeights g = moe_weights_from_buffer(cfg, r.grads.data());
  std::vector<uint16_t> copy(p.size());
  if (lp != DType::F32) {
    f32_to_dtype(lp, copy.data(), p.data(), p.size());
    auto at = [&](const float* f) -> const void* {
      return f ? copy.data() + (f - p.data()) : nullptr;
    };
    w.lp = lp;
    w.w1_lp = at(w.w1), w.w3_lp = at(w.w3), w.w2_lp = at(w.w2);
    w.shared_w1_lp = at(w.shared_w1), w.shared_w3_lp = at(w.shared_w3);
    w.shared_w2_lp = at(w.shared_w2);
  }
  MoeLayer layer(cfg);
  MoeStep step;
  r.out.resize(N * cfg.C);
  r.dinp.resize(N * cfg.C);
  layer.forward(r.out.data(), inp.data(), N, w, step);
  layer.backward(r.dinp.data(), dout.data(), w, g, 1.0f);
  r.selected = layer.routing().selected;
  return r;
}

void check_layer(const MoeConfig& cfg, int64_t N) {
  const int64_t total = moe_param_sizes(cfg).total();
  const std::vector<float> params = moetrain::testing::random_vector(total, 21, 0.2f);
  const std::vector<float> inp = moetrain::testing::random_vector(N * cfg.C, 22);
  const std::vector<float> dout = moetrain::testing::random_vector(N * cfg.C, 23);
  const Run ref = run_layer(cfg, params, inp, dout, N, DType::F32);
  for (DType t : {DType::BF16, DType::F16}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const Run r = run_layer(cfg, params, inp, dout, N, t);
    // The router saw the same f32 tokens and gate: the same experts, whatever the precision.
    EXPECT_EQ(r.selected, ref.selected);
    // Tolerances: relative norm error 2% (bf16) / 0.3% (fp16) for outputs and gradients.
    const double tol = t == DType::BF16 ? 2e-2 : 3e-3;
    EXPECT_LT(rel_norm_error(r.out.data(), ref.out.data(), N * cfg.C), tol);
    EXPECT_LT(rel_norm_error(r.dinp.data(), ref.dinp.data(), N * cfg.C), tol);
    MoeWeights gr = moe_weights_from_buffer(cfg, const_cast<float*>(r.grads.data()));
    MoeWeights gf = moe_weights_from_buffer(cfg, const_cast<float*>(ref.grads.data()));
    const MoeParamSizes s = moe_param_sizes(cfg);
    EXPECT_LT(rel_norm_error(gr.w1, gf.w1, s.w1), tol) << "dW1";
    EXPECT_LT(rel_norm_error(gr.w2, gf.w2, s.w2), tol) << "dW2";
    EXPECT_LT(rel_norm_error(gr.w3, gf.w3, s.w3), tol) << "dW3";
    EXPECT_LT(rel_norm_error(gr.gate, gf.gate, s.gate), tol) << "dgate";
    if (s.shared_w1) {
      EXPECT_LT(rel_norm_error(gr.shared_w1, gf.shared_w1, s.shared_w1), tol);
    }
    // The low precision is really in use.
    EXPECT_GT(rel_norm_error(r.out.data(), ref.out.data(), N * cfg.C), 1e-6);
  }
}

}  // namespace

TEST(MoePrecision, LayerTracksF32) {
  MoeConfig cfg;
  cfg.C = 48, cfg.F = 64, cfg.E = 8, cfg.K = 2;
  check_layer(cfg, 300);  // large enough for oneDNN tasks, not only the small-GEMM loops
}

TEST(MoePrecision, SmallLayerWithSharedExpertAndEmptyExperts) {
  MoeConfig cfg;
  cfg.C = 8, cfg.F = 12, cfg.E = 16, cfg.K = 1, cfg.shared_F = 6;
  check_layer(cfg, 5);  // most experts get no token
}

TEST(MoePrecision, MissingWeightCopiesAreAnError) {
  MoeConfig cfg;
  cfg.C = 8, cfg.F = 8, cfg.E = 2, cfg.K = 1;
  std::vector<float> p(moe_param_sizes(cfg).total(), 0.1f), inp(4 * 8, 1.0f), out(4 * 8);
  MoeWeights w = moe_weights_from_buffer(cfg, p.data());
  w.lp = DType::BF16;  // but no copies
  MoeLayer layer(cfg);
  EXPECT_THROW(layer.forward(out.data(), inp.data(), 4, w, MoeStep{}), Error);
}
