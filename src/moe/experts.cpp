#include "moe/experts.h"

#include "core/check.h"
#include "core/profile.h"
#include "kernels/activation.h"
#include "kernels/det_gemm.h"

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
  if (w.lp != DType::F32) {
    const int64_t bytes = first * block * static_cast<int64_t>(dtype_size(w.lp));
    auto at = [bytes](const void* p) {
      return p ? static_cast<const void*>(static_cast<const char*>(p) + bytes) : nullptr;
    };
    r.lp = w.lp;
    r.w1_lp = at(w.w1_lp), r.w3_lp = at(w.w3_lp), r.w2_lp = at(w.w2_lp);
  }
  return r;
}

ExpertRange shared_expert_range(const MoeWeights& w) {
  ExpertRange r;
  r.first = 0;
  r.count = 1;
  r.w1 = w.shared_w1;
  r.w3 = w.shared_w3;
  r.w2 = w.shared_w2;
  if (w.lp != DType::F32) {
    r.lp = w.lp;
    r.w1_lp = w.shared_w1_lp, r.w3_lp = w.shared_w3_lp, r.w2_lp = w.shared_w2_lp;
  }
  return r;
}

namespace {

void round_rows(bf16* out, const float* in, int64_t n) {
  round_to_bf16(out, in, n);
}
void round_rows(fp16* out, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fp16(in[i]);
}

template <class T>
void experts_forward_lp(float* y, const float* xp, const std::vector<RowBlock>& blocks, int64_t R,
                        const ExpertRange& w, int64_t C, int64_t F, ExpertActs& acts) {
  MOETRAIN_CHECK(w.w1_lp && w.w3_lp && w.w2_lp,
                 "experts_forward: {} experts without their {} weight copies", w.count,
                 dtype_name(w.lp));
  float* a = acts.a.ensure(R * F);
  float* b = acts.b.ensure(R * F);
  T* xl = static_cast<T*>(acts.xp_lp.ensure(R * C));
  T* gl = static_cast<T*>(acts.g_lp.ensure(R * F));
  const T* w1 = static_cast<const T*>(w.w1_lp);
  const T* w3 = static_cast<const T*>(w.w3_lp);
  const T* w2 = static_cast<const T*>(w.w2_lp);
  const int64_t block = F * C, n = static_cast<int64_t>(blocks.size());
#pragma omp parallel for schedule(dynamic, 1) if (!is_small_gemm(R, F, C))
  for (int64_t i = 0; i < n; ++i) {
    const RowBlock& t = blocks[i];
    const int64_t r0 = t.row0;
    round_rows(xl + r0 * C, xp + r0 * C, t.rows * C);
    task_gemm(Trans::T, t.rows, F, C, xl + r0 * C, w1 + t.group * block, a + r0 * F, false);
    task_gemm(Trans::T, t.rows, F, C, xl + r0 * C, w3 + t.group * block, b + r0 * F, false);
    swiglu_forward(gl + r0 * F, a + r0 * F, b + r0 * F, t.rows * F);
    task_gemm(Trans::T, t.rows, C, F, gl + r0 * F, w2 + t.group * block, y + r0 * C, false);
  }
}

template <class T>
void experts_backward_lp(float* dxp, const ExpertRange& dw, const float* dy,
                         const std::vector<RowBlock>& blocks, int64_t R, const int64_t* counts,
                         const ExpertRange& w, int64_t C, int64_t F, ExpertActs& acts) {
  const float* a = acts.a.data();
  const float* b = acts.b.data();
  float* dg = acts.dg.ensure(R * F);
  const T* xl = acts.xp_lp.as<T>();
  const T* gl = acts.g_lp.as<T>();
  T* dyl = static_cast<T*>(acts.dy_lp.ensure(R * C));
  T* dal = static_cast<T*>(acts.da_lp.ensure(R * F));
  T* dbl = static_cast<T*>(acts.db_lp.ensure(R * F));
  const T* w1 = static_cast<const T*>(w.w1_lp);
  const T* w3 = static_cast<const T*>(w.w3_lp);
  const T* w2 = static_cast<const T*>(w.w2_lp);
  const int64_t block = F * C, n = static_cast<int64_t>(blocks.size());
#pragma omp parallel for schedule(dynamic, 1) if (!is_small_gemm(R, F, C))
  for (int64_t i = 0; i < n; ++i) {
    const RowBlock& t = blocks[i];
    const int64_t r0 = t.row0;
    round_rows(dyl + r0 * C, dy + r0 * C, t.rows * C);
    task_gemm(Trans::N, t.rows, F, C, dyl + r0 * C, w2 + t.group * block, dg + r0 * F, false);
    swiglu_backward(dal + r0 * F, dbl + r0 * F, dg + r0 * F, a + r0 * F, b + r0 * F, t.rows * F);
    task_gemm(Trans::N, t.rows, C, F, dal + r0 * F, w1 + t.group * block, dxp + r0 * C, false);
    task_gemm(Trans::N, t.rows, C, F, dbl + r0 * F, w3 + t.group * block, dxp + r0 * C, true);
  }
  const ReduceProblem problems[3] = {{C, F, dyl, gl, dw.w2, block, w.lp},
                                     {F, C, dal, xl, dw.w1, block, w.lp},
                                     {F, C, dbl, xl, dw.w3, block, w.lp}};
  grouped_gemm_reduce_det(w.count, counts, problems, 3, true);
}

}  // namespace

void experts_forward(float* y, const float* xp, const int64_t* counts, const ExpertRange& w,
                     int64_t C, int64_t F, ExpertActs& acts) {
  PhaseScope phase_scope(Phase::Experts);
  const int64_t G = w.count;
  MOETRAIN_CHECK(G >= 0 && C > 0 && F > 0, "experts_forward: count={} C={} F={}", G, C, F);
  std::vector<RowBlock> blocks = row_blocks(counts, G);
  const int64_t R = blocks.empty() ? 0 : blocks.back().row0 + blocks.back().rows;
  largest_first(blocks);
  if (R == 0) return;
  MOETRAIN_CHECK(w.w1 && w.w3 && w.w2 && y && xp,
                 "experts_forward: null weight or buffer for {} rows", R);
  if (w.lp == DType::BF16) return experts_forward_lp<bf16>(y, xp, blocks, R, w, C, F, acts);
  if (w.lp == DType::F16) return experts_forward_lp<fp16>(y, xp, blocks, R, w, C, F, acts);
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
  PhaseScope phase_scope(Phase::Experts);
  const int64_t G = w.count;
  MOETRAIN_CHECK(dw.count == G, "experts_backward: gradient range has {} experts, weights {}",
                 dw.count, G);
  std::vector<RowBlock> blocks = row_blocks(counts, G);
  const int64_t R = blocks.empty() ? 0 : blocks.back().row0 + blocks.back().rows;
  largest_first(blocks);
  if (R == 0) return;
  MOETRAIN_CHECK(dw.w1 && dw.w3 && dw.w2 && dxp && dy,
                 "experts_backward: null gradient or buffer for {} rows", R);
  if (w.lp == DType::BF16)
    return experts_backward_lp<bf16>(dxp, dw, dy, blocks, R, counts, w, C, F, acts);
  if (w.lp == DType::F16)
    return experts_backward_lp<fp16>(dxp, dw, dy, blocks, R, counts, w, C, F, acts);
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
  const ReduceProblem problems[3] = {{C, F, dy, g, dw.w2, block, DType::F32},
                                     {F, C, da, xp, dw.w1, block, DType::F32},
                                     {F, C, db, xp, dw.w3, block, DType::F32}};
  grouped_gemm_reduce_det(G, counts, problems, 3, true);
}

}  // namespace moetrain
