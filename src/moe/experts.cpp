#include "moe/experts.h"

#include "core/check.h"
#include "kernels/activation.h"
#include "moe/det_gemm.h"

namespace moetrain {

ExpertRange expert_range(const MoeWeights& w, const MoeConfig& cfg, int64_t first, int64_t count) {
  MOETRAIN_CHECK(first >= 0 && count >= 0 && first + count <= cfg.E,
                 "expert_range: experts [{}, {}) are outside [0, E={})", first, first + count,
                 cfg.E);
  const int64_t block = cfg.F * cfg.C;
  ExpertRange r;
  r.first = first;
  r.count = count;
  r.w1 = w.w1 ? w.w1 + first * block : nullptr;
  r.w3 = w.w3 ? w.w3 + first * block : nullptr;
  r.w2 = w.w2 ? w.w2 + first * block : nullptr;
  return r;
}

ExpertRange shared_expert_range(const MoeWeights& w) {
  ExpertRange r;
  r.first = 0;
  r.count = 1;
  r.w1 = w.shared_w1;
  r.w3 = w.shared_w3;
  r.w2 = w.shared_w2;
  return r;
}

void experts_forward(float* y, const float* xp, const int64_t* counts, const ExpertRange& w,
                     int64_t C, int64_t F, ExpertActs& acts) {
  const int64_t G = w.count;
  MOETRAIN_CHECK(G >= 0 && C > 0 && F > 0, "experts_forward: count={} C={} F={}", G, C, F);
  const std::vector<RowBlock> blocks = row_blocks(counts, G);
  const int64_t R = blocks.empty() ? 0 : blocks.back().row0 + blocks.back().rows;
  if (R == 0) return;
  MOETRAIN_CHECK(w.w1 && w.w3 && w.w2 && y && xp,
                 "experts_forward: null weight or buffer for {} rows", R);
  float* a = acts.a.ensure(R * F);
  float* b = acts.b.ensure(R * F);
  float* g = acts.g.ensure(R * F);
  const int64_t block = F * C, n = static_cast<int64_t>(blocks.size());
  // A row block runs the whole expert while its hidden rows are still in cache.
#pragma omp parallel for schedule(dynamic, 1) if (!is_small_gemm(R, F, C))
  for (int64_t i = 0; i < n; ++i) {
    const RowBlock& t = blocks[i];
    const int64_t r0 = t.row0;
    task_gemm(Trans::T, t.rows, F, C, xp + r0 * C, w.w1 + t.group * block, a + r0 * F, false);
    task_gemm(Trans::T, t.rows, F, C, xp + r0 * C, w.w3 + t.group * block, b + r0 * F, false);
    swiglu_forward(g + r0 * F, a + r0 * F, b + r0 * F, t.rows * F);
    task_gemm(Trans::T, t.rows, C, F, g + r0 * F, w.w2 + t.group * block, y + r0 * C, false);
  }
}

void experts_backward(float* dxp, const ExpertRange& dw, const float* dy, const float* xp,
                      const int64_t* counts, const ExpertRange& w, int64_t C, int64_t F,
                      ExpertActs& acts) {
  const int64_t G = w.count;
  MOETRAIN_CHECK(dw.count == G, "experts_backward: gradient range has {} experts, weights {}",
                 dw.count, G);
  const std::vector<RowBlock> blocks = row_blocks(counts, G);
  const int64_t R = blocks.empty() ? 0 : blocks.back().row0 + blocks.back().rows;
  if (R == 0) return;
  MOETRAIN_CHECK(dw.w1 && dw.w3 && dw.w2 && dxp && dy,
                 "experts_backward: null gradient or buffer for {} rows", R);
  const float* a = acts.a.data();
  const float* b = acts.b.data();
  const float* g = acts.g.data();
  float* dg = acts.dg.ensure(R * F);
  float* da = acts.da.ensure(R * F);
  float* db = acts.db.ensure(R * F);
  const int64_t block = F * C, n = static_cast<int64_t>(blocks.size());
#pragma omp parallel for schedule(dynamic, 1) if (!is_small_gemm(R, F, C))
  for (int64_t i = 0; i < n; ++i) {
    const RowBlock& t = blocks[i];
    const int64_t r0 = t.row0;
    // dg = dy · W2;  (da, db) = swiglu'(dg);  dxp = da · W1 + db · W3
    task_gemm(Trans::N, t.rows, F, C, dy + r0 * C, w.w2 + t.group * block, dg + r0 * F, false);
    swiglu_backward(da + r0 * F, db + r0 * F, dg + r0 * F, a + r0 * F, b + r0 * F, t.rows * F);
    task_gemm(Trans::N, t.rows, C, F, da + r0 * F, w.w1 + t.group * block, dxp + r0 * C, false);
    task_gemm(Trans::N, t.rows, C, F, db + r0 * F, w.w3 + t.group * block, dxp + r0 * C, true);
  }
  // dW2 (C, F) += dyᵀ · g;  dW1 (F, C) += daᵀ · xp;  dW3 (F, C) += dbᵀ · xp
  const ReduceProblem problems[3] = {
      {C, F, dy, g, dw.w2, block}, {F, C, da, xp, dw.w1, block}, {F, C, db, xp, dw.w3, block}};
  grouped_gemm_reduce_det(G, counts, problems, 3, true);
}

}  // namespace moetrain
