// One block's attention in the planner (plan/attention_model.h).
#include "plan/attention_model.h"

#include "plan/kernel_time.h"

namespace moetrain::plan {

AttentionFlops attention_forward_flops(const ModelConfig& m, int64_t layer, int64_t B, int64_t T) {
  AttentionFlops f;
  const double N = static_cast<double>(B * T);
  // Every projection weight is one multiply-add per token; MLA's latent norms are not GEMMs.
  const double norms = m.mla() ? static_cast<double>(m.q_lora_rank + m.kv_lora_rank) : 0.0;
  f.proj = 2 * N * (static_cast<double>(m.attention_params()) - norms);
  // Query t meets its causal keys (all t + 1, or the last W of them in a windowed block): q·kᵀ
  // of the query/key width and p·v of the value width, per head.
  f.scores = 2 * static_cast<double>(B) * static_cast<double>(m.n_heads) * m.attention_pairs(layer, T) *
             static_cast<double>(m.qk_head_dim() + m.value_head_dim());
  return f;
}

double attention_time(const DeviceModel& dev, DType prec, const ModelConfig& m, int64_t layer,
                      int64_t B, int64_t T, int64_t tp, double ab) {
  const double N = static_cast<double>(B * T), C = static_cast<double>(m.dim);
  const int64_t NHt = m.n_heads / tp, NKVt = m.mla() ? NHt : m.n_kv_heads / tp;
  const double nh = static_cast<double>(NHt), qk = static_cast<double>(m.qk_head_dim()),
               v = static_cast<double>(m.value_head_dim());
  double t = 0;
  // Tensor parallelism splits the heads: the per-head projections by columns (Q, K, V, MLA's
  // up-projections) and O by rows; MLA's down-projections to the latents are replicated.
  if (!m.mla()) {
    const double HS = static_cast<double>(m.head_dim());
    t += linear_fb_time(dev, prec, N, nh * HS, C) +
         2 * linear_fb_time(dev, prec, N, static_cast<double>(NKVt) * HS, C) +
         linear_fb_time(dev, prec, N, C, nh * HS);
  } else {
    const double qr = static_cast<double>(m.q_lora_rank), kvr = static_cast<double>(m.kv_lora_rank);
    const double rope = static_cast<double>(m.qk_rope_head_dim);
    t += m.q_lora_rank > 0 ? linear_fb_time(dev, prec, N, qr, C) +
                                 linear_fb_time(dev, prec, N, nh * qk, qr) +
                                 rmsnorm_time(dev, N, qr, 1, ab)
                           : linear_fb_time(dev, prec, N, nh * qk, C);
    t += linear_fb_time(dev, prec, N, kvr + rope, C) +
         linear_fb_time(dev, prec, N, nh * (static_cast<double>(m.qk_nope_head_dim) + v), kvr) +
         rmsnorm_time(dev, N, kvr, 1, ab) + linear_fb_time(dev, prec, N, C, nh * v);
  }
  // Scores and values: forward 2 products; a flash-style backward recomputes the scores and
  // forms dP, dQ, dK, dV: 5 products, so forward + backward = 3.5× the forward's 2.
  // Without a measured rate (accelerators), a fused (flash) kernel at the precision's
  // tensor-core peak, thinned by the head size as a GEMM of that smallest side would be.
  // Where the profile timed the attention core at this very shape (full causal attention of
  // equal query/key and value widths: the trainer's), that time.
  const double pairs = m.attention_pairs(layer, T);
  const double score_flops = 3.5 * 2 * static_cast<double>(B) * nh * pairs * (qk + v);
  const double hs = (qk + v) / 2;
  const bool trainer_shape = !m.mla() && m.attention_window(layer) == 0;
  const auto att = trainer_shape ? dev.kernels.find("attention", {double(B), double(T), nh,
                                                                  double(NKVt), hs})
                                 : std::nullopt;
  t += att                       ? *att
       : dev.attention_flops > 0 ? score_flops / dev.attention_flops
                                 : score_flops / (peak_of(dev, prec) * dev.gemm_max_efficiency) *
                                       (1 + dev.gemm_small_dim / hs);
  // RoPE on q and k: read and write, forward and backward (or as timed at this shape: it
  // computes its rotations, more than a stream). MLA rotates the queries' rope part per head and
  // one shared rope key per token.
  if (m.mla()) {
    const double rope = static_cast<double>(m.qk_rope_head_dim);
    t += stream_time(dev, 2 * 2 * ab * N * (nh + 1) * rope);
  } else {
    const double HS = static_cast<double>(m.head_dim());
    const auto rope_q = dev.kernels.find("rope", {N, nh, HS});
    const auto rope_k = dev.kernels.find("rope", {N, double(NKVt), HS});
    t += rope_q && rope_k ? *rope_q + *rope_k
                          : stream_time(dev, 2 * 2 * ab * N * (nh + static_cast<double>(NKVt)) * HS);
  }
  return t;
}

double mla_up_proj_recompute_time(const DeviceModel& dev, DType prec, const ModelConfig& m,
                                  int64_t B, int64_t T, int64_t tp) {
  if (!m.mla()) return 0;
  const double N = static_cast<double>(B * T), nh = static_cast<double>(m.n_heads / tp);
  // With q_lora_rank = 0 the queries come from x directly: no up-projection to rerun.
  const double up_q = m.q_lora_rank > 0
                          ? linear_fb_time(dev, prec, N, nh * static_cast<double>(m.qk_head_dim()),
                                           static_cast<double>(m.q_lora_rank))
                          : 0.0;
  const double up_kv = linear_fb_time(
      dev, prec, N, nh * static_cast<double>(m.qk_nope_head_dim + m.value_head_dim()),
      static_cast<double>(m.kv_lora_rank));
  return (up_q + up_kv) / 3;
}

}  // namespace moetrain::plan
