// The whole Transformer in mixed precision: loss and every parameter group's gradient against
// the f32 model on the same parameters and batch.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "model/params.h"
#include "model/transformer.h"
#include "support/small_models.h"

using namespace moetrain;

namespace {

ModelConfig config() {
  ModelConfig c = moetrain::testing::small_lm(40, 32, 24, 2);
  c.shared_expert_hidden = 16;
  c.dense_every = 2;  // layer 1 dense: every kind of GEMM of the model
  c.max_seq_len = 128;
  return c;
}

struct Result {
  LossParts loss;
  std::vector<float> grads;
};

Result run(Transformer& model, const std::vector<float>& params, int64_t B, int64_t T) {
  std::vector<int32_t> inputs(B * T), targets(B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    inputs[i] = static_cast<int32_t>((i * 7 + 3) % 40);
    targets[i] = static_cast<int32_t>((i * 11 + 5) % 40);
  }
  Result r;
  r.grads.assign(params.size(), 0.0f);
  MoeStep step;
  r.loss = model.forward(params.data(), inputs.data(), targets.data(), B, T, step);
  model.backward(params.data(), r.grads.data(), 1.0f);
  return r;
}

// Relative norm error of each tensor's gradient, by tensor name.
std::map<std::string, double> grad_errors(const ParamLayout& layout, const std::vector<float>& a,
                                          const std::vector<float>& ref) {
  std::map<std::string, double> out;
  for (const ParamInfo& p : layout.params()) {
    double num = 0, den = 0;
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
      den += double(ref[i]) * ref[i];
    }
    if (den > 0) out[p.name] = std::sqrt(num / den);
  }
  return out;
}

}  // namespace

TEST(TransformerPrecision, ForwardAndGradientsTrackF32) {
  const ModelConfig cfg = config();
  Transformer model(cfg);
  std::vector<float> params(model.layout().size());
  init_params(params.data(), model.layout(), cfg, 5);
  // bf16 at T = 128 too: where the CPU has AVX512_BF16, its attention core takes bf16 products
  // there (attention_bf16_pays).
  for (const int64_t T : {24, 128}) {
    const int64_t B = 2;
    const Result ref = run(model, params, B, T);
    for (DType t : {DType::BF16, DType::F16}) {
      if (t == DType::F16 && T != 24) continue;
      SCOPED_TRACE(std::string(dtype_name(t)) + " T=" + std::to_string(T));
      Transformer lp(cfg);
      lp.set_precision(t);
      const Result r = run(lp, params, B, T);
      // Loss within 0.5% (bf16) / 0.1% (fp16); each tensor's gradient within 5% / 1% in relative
      // norm (the small gradients of norms and the router are the noisiest).
      const double loss_tol = t == DType::BF16 ? 5e-3 : 1e-3;
      const double grad_tol = t == DType::BF16 ? 5e-2 : 1e-2;
      EXPECT_NEAR(r.loss.total, ref.loss.total, loss_tol * ref.loss.total);
      EXPECT_NE(r.loss.total, ref.loss.total);  // the rounding happened
      int64_t checked = 0;
      for (const auto& [name, err] : grad_errors(model.layout(), r.grads, ref.grads)) {
        EXPECT_LT(err, grad_tol) << name;
        ++checked;
      }
      EXPECT_GT(checked, 20);
    }
  }
}

TEST(TransformerPrecision, WeightCopyFollowsTheParameters) {
  const ModelConfig cfg = config();
  Transformer model(cfg);
  model.set_precision(DType::BF16);
  std::vector<float> params(model.layout().size());
  init_params(params.data(), model.layout(), cfg, 5);
  const Result a = run(model, params, 1, 8);
  const Result again = run(model, params, 1, 8);
  EXPECT_EQ(a.loss.total, again.loss.total);
  EXPECT_EQ(a.grads, again.grads);  // deterministic
  // Changed in place: the copy is stale until weights_changed().
  std::vector<float>& p = params;
  const int64_t head = model.layout().lm_head;
  for (int64_t i = 0; i < cfg.dim * cfg.vocab_size; ++i) p[head + i] *= 2.0f;
  model.weights_changed();
  const Result b = run(model, params, 1, 8);
  EXPECT_NE(a.loss.total, b.loss.total);
  // The same as a fresh model on the new parameters.
  Transformer fresh(cfg);
  fresh.set_precision(DType::BF16);
  EXPECT_EQ(run(fresh, params, 1, 8).loss.total, b.loss.total);
}

TEST(TransformerPrecision, F32IsUnchangedBySettingItExplicitly) {
  const ModelConfig cfg = config();
  Transformer a(cfg), b(cfg);
  b.set_precision(DType::F32);
  std::vector<float> params(a.layout().size());
  init_params(params.data(), a.layout(), cfg, 9);
  const Result ra = run(a, params, 2, 8), rb = run(b, params, 2, 8);
  EXPECT_EQ(ra.loss.total, rb.loss.total);
  EXPECT_EQ(ra.grads, rb.grads);
}
