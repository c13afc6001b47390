#include "plan/flops.h"

#include "plan/attention_model.h"

namespace moetrain::plan {

ForwardFlops forward_flops(const ModelConfig& m, int64_t B, int64_t T) {
  ForwardFlops f;
  const double N = static_cast<double>(B * T), C = m.dim;
  const double Lm = m.n_moe_layers(), Ld = m.n_layers - Lm;
  // Projections and the causal (windowed) scores and values, block by block
  // (plan/attention_model.h).
  for (int64_t l = 0; l < m.n_layers; ++l) {
    const AttentionFlops a = attention_forward_flops(m, l, B, T);
    f.attention_proj += a.proj;
    f.attention_scores += a.scores;
  }
  f.router = Lm * 2 * N * C * m.n_experts;
  // Each token's K experts run the SwiGLU FFN: w1, w3 (C → F) and w2 (F → C).
  f.experts = Lm * 3 * 2 * N * m.top_k * C * m.expert_hidden;
  f.shared =
      Lm * 3 * 2 * N * C * m.shared_expert_hidden + Ld * 3 * 2 * N * C * m.dense_ffn_hidden();
  f.lm_head = 2 * N * C * m.vocab_size;
  return f;
}

}  // namespace moetrain::plan
