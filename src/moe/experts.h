// Expert compute over the expert-grouped buffer: per expert j, SwiGLU
//   y = W2_j · (silu(W1_j·x) ⊙ (W3_j·x))   (Mixtral's w1, w3, w2)
// as grouped GEMMs over the rows of each expert. An expert with no rows costs nothing and its
// weight gradients are left untouched.
#pragma once
#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "moe/config.h"

namespace moetrain {

// The weights of experts [first, first + count) by global expert id. Each pointer is at expert
// `first`, so a process holding only its own experts passes its local buffers.
struct ExpertRange {
  int64_t first = 0, count = 0;
  float* w1 = nullptr;  // (count, F, C)
  float* w3 = nullptr;  // (count, F, C)
  float* w2 = nullptr;  // (count, C, F)
  // Mixed precision (see MoeWeights::lp): copies of w1, w3, w2 in `lp` at expert `first`.
  DType lp = DType::F32;
  const void* w1_lp = nullptr;  // (count, F, C)
  const void* w3_lp = nullptr;  // (count, F, C)
  const void* w2_lp = nullptr;  // (count, C, F)
};
// Experts [first, first + count) of a layer's full weight (or gradient) views.
ExpertRange expert_range(const MoeWeights& w, const MoeConfig& cfg, int64_t first, int64_t count);
// The shared expert as a one-expert range (Fs = cfg.shared_F).
ExpertRange shared_expert_range(const MoeWeights& w);

// What experts_backward needs from the forward, and its scratch. All (rows, F) but xp_lp and
// dy_lp (rows, C). The *_lp buffers are used in mixed precision only: the GEMM operands rounded
// to the weights' lp type (the rounded xp and g are what the weight gradients need).
struct ExpertActs {
  FloatBuffer a, b, g;     // W1·x, W3·x, silu(a) ⊙ b (g: f32 weights only)
  FloatBuffer dg, da, db;  // backward scratch (da, db: f32 weights only)
  HalfBuffer xp_lp, g_lp, dy_lp, da_lp, db_lp;

  // Gives every buffer back (activation recomputation drops them between uses).
  void release() {
    for (FloatBuffer* f : {&a, &b, &g, &dg, &da, &db}) f->release();
    for (HalfBuffer* h : {&xp_lp, &g_lp, &dy_lp, &da_lp, &db_lp}) h->release();
  }
  // Bytes the forward's intermediates hold (a, b, g, xp_lp, g_lp), and the backward's scratch.
  int64_t forward_bytes() const {
    return a.bytes() + b.bytes() + g.bytes() + xp_lp.bytes() + g_lp.bytes();
  }
  int64_t scratch_bytes() const {
    return dg.bytes() + da.bytes() + db.bytes() + dy_lp.bytes() + da_lp.bytes() + db_lp.bytes();
  }
};

// In mixed precision (w.lp bf16 or fp16) every GEMM takes its operands rounded to w.lp and
// accumulates in f32; SwiGLU and its gradient are computed in f32 and written rounded (g, da and
// db exist only as the next GEMM's operands).
// y (R, C) = experts over xp (R, C), where the rows of expert first+i are the next counts[i]
// rows (R = Σ counts). counts (w.count). F is the hidden size. Bitwise the same for any thread
// count (see det_gemm.h).
void experts_forward(float* y, const float* xp, const int64_t* counts, const ExpertRange& w,
                     int64_t C, int64_t F, ExpertActs& acts);
// dxp (R, C) =, dw (weight gradients) +=. dy (R, C), xp as in the forward.
void experts_backward(float* dxp, const ExpertRange& dw, const float* dy, const float* xp,
                      const int64_t* counts, const ExpertRange& w, int64_t C, int64_t F,
                      ExpertActs& acts);

}  // namespace moetrain
