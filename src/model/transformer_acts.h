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
  Floats ln1, rstd1;  // (N, C), (N)
  Floats q, k, v;     // (N, NH·HS), (N, NKV·HS), (N, NKV·HS); q and k after RoPE
  Floats att, lse;    // (N, NH·HS), (B, NH, T)
  Floats xmid;        // (N, C) residual after attention
  Floats ln2, rstd2;  // (N, C), (N)
  Floats ffn;         // (N, C) MoE or dense output
  Floats h1, h3, g;   // dense blocks only: (N, Fd) each
  // Mixed precision: GEMM inputs rounded, kept for the weight gradients. (N, C), (N, NH·HS),
  // (N, C) dense blocks only, (N, Fd) dense blocks only.
  HalfBuffer ln1_lp, att_lp, ln2_lp, g_lp;

  int64_t bytes() const {
    int64_t n = 0;
    for (const Floats* f :
         {&ln1, &rstd1, &q, &k, &v, &att, &lse, &xmid, &ln2, &rstd2, &ffn, &h1, &h3, &g})
      n += f->bytes();
    for (const HalfBuffer* h : {&ln1_lp, &att_lp, &ln2_lp, &g_lp}) n += h->bytes();
    return n;
  }
};

}  // namespace moetrain
