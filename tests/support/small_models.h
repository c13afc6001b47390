// The small models the model, training and MPI tests build. Each test sets what it needs on top.
#pragma once
#include <cstdint>

#include "model/classifier.h"
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

// The small MoE classifier: 13 inputs, 5 classes, 2 blocks of dim 16, 4 experts of hidden 12.
inline ClassifierConfig small_classifier(int64_t top_k) {
  ClassifierConfig c;
  c.input_dim = 13;
  c.n_classes = 5;
  c.dim = 16;
  c.n_layers = 2;
  c.expert_hidden = 12;
  c.n_experts = 4;
  c.top_k = top_k;
  return c;
}

}  // namespace moetrain::testing
