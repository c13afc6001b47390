// What one block of the Transformer keeps for its backward (one set per block; one shared set
// under train.recompute = full). Private to src/model/transformer*.cpp.
#pragma once
#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "model/transformer.h"

namespace moetrain {

// N = B·T tokens.
struct Transformer::LayerActs {
  std::vector<float> ln1, rstd1;  // (N, C), (N)
  std::vector<float> q, k, v;     // (N, NH·HS), (N, NKV·HS), (N, NKV·HS); q and k after RoPE
  std::vector<float> att, lse;    // (N, NH·HS), (B, NH, T)
  std::vector<float> xmid;        // (N, C) residual after attention
  std::vector<float> ln2, rstd2;  // (N, C), (N)
  std::vector<float> ffn;         // (N, C) MoE or dense output
  std::vector<float> h1, h3, g;   // dense blocks only: (N, Fd) each
  // Mixed precision: GEMM inputs rounded, kept for the weight gradients. (N, C), (N, NH·HS),
  // (N, C) dense blocks only, (N, Fd) dense blocks only.
  HalfBuffer ln1_lp, att_lp, ln2_lp, g_lp;

  int64_t bytes() const {
    int64_t n = 0;
    for (const std::vector<float>* v : {&ln1, &rstd1, &q, &k, &v, &att, &lse, &xmid, &ln2, &rstd2,
                                        &ffn, &h1, &h3, &g})
      n += static_cast<int64_t>(v->capacity() * sizeof(float));
    for (const HalfBuffer* h : {&ln1_lp, &att_lp, &ln2_lp, &g_lp}) n += h->bytes();
    return n;
  }
};

}  // namespace moetrain
