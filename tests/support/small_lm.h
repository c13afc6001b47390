// The small language models the model, training and MPI tests build: 2 layers, 4 query heads
// over 2 key/value heads, 4 experts. Each test sets what it needs on top.
#pragma once
#include <cstdint>

#include "model/config.h"

namespace moetrain::testing {

inline ModelConfig small_lm(int64_t vocab, int64_t dim, int64_t expert_hidden, int64_t top_k) {
  ModelConfig c;
  c.vocab_size = vocab;
  c.dim = dim;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.expert_hidden = expert_hidden;
  c.n_experts = 4;
  c.top_k = top_k;
  return c;
}

}  // namespace moetrain::testing
