#include "kernels/norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/profile.h"
#include "kernels/lane_sum.h"

namespace moetrain {

namespace {
// Rows (or column blocks) below this much work are cheaper on one thread than a fork/join.
constexpr int64_t kParallelMin = 1 << 14;
// Rows per partial sum of the weight gradient: fixed, so that the order of its sums never depends
// on the thread count (cuda/norm.cu's tiles are these chunks, for the same bits on the GPU).
constexpr int64_t kRowChunk = 256;
// Columns per task of adding the chunks' sums into the weight gradient.
constexpr int64_t kAddCols = 256;

// The row loops, cloned for the instruction sets (picked at load time) instead of the baseline
// SSE2 build (two doubles a vector): the same operations in the same order in each clone
// (lane_sum8's fixed chains, no FMA contraction), so the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOETRAIN_NORM_HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MOETRAIN_NORM_HOT
#endif

MOETRAIN_NORM_HOT float forward_row(float* y, const float* x, const float* weight, int64_t C,
                                    float eps) {
  // A double sum keeps mean(x²) accurate for wide rows (each x² is exact in double).
  const double ss = lane_sum8(C, [x](int64_t c) { return double(x[c]) * x[c]; });
  const float r = static_cast<float>(1.0 / std::sqrt(ss / double(C) + double(eps)));
  // HF order: normalise first, then scale by the weight.
  for (int64_t c = 0; c < C; ++c) y[c] = weight[c] * (x[c] * r);
  return r;
}

// The row's sum and its norm: x += add, then forward_row.
MOETRAIN_NORM_HOT float add_forward_row(float* y, float* x, const float* add, const float* weight,
                                        int64_t C, float eps) {
  for (int64_t c = 0; c < C; ++c) x[c] += add[c];
  return forward_row(y, x, weight, C, eps);
}

// res: null, or the residual branch's gradient added to the row's. dw: null, or the row's terms
// of the weight gradient added to it, dw[c] += dy_c x_c r.
MOETRAIN_NORM_HOT void backward_row(float* dx, const float* dy, const float* x, const float* weight,
                                    double r, int64_t C, const float* res, double* dw) {
  const double dot =
      lane_sum8(C, [dy, weight, x](int64_t c) { return double(dy[c]) * weight[c] * x[c]; });
  const float k = static_cast<float>(r * r * r * dot / double(C));
  const float rf = static_cast<float>(r);
  if (res == nullptr) {
    for (int64_t c = 0; c < C; ++c) dx[c] = rf * weight[c] * dy[c] - k * x[c];
  } else {
    for (int64_t c = 0; c < C; ++c) dx[c] = (rf * weight[c] * dy[c] - k * x[c]) + res[c];
  }
  if (dw != nullptr)
    for (int64_t c = 0; c < C; ++c) dw[c] += double(dy[c]) * x[c] * r;
}

// dweight[c] += Σ over the chunks, in order, of their partial sums.
MOETRAIN_NORM_HOT void add_partials(float* dweight, const double* partial, int64_t chunks,
                                    int64_t C, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) {
    double sum = partial[c];
    for (int64_t k = 1; k < chunks; ++k) sum += partial[k * C + c];
    dweight[c] += static_cast<float>(sum);
  }
}
}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps) {
  PhaseScope phase_scope(Phase::Norm);
  MOETRAIN_CHECK(N >= 0 && C > 0, "rmsnorm_forward: need N >= 0 and C > 0, got N={} C={}", N, C);
  MOETRAIN_CHECK(eps >= 0.0f, "rmsnorm_forward: eps must be >= 0, got {}", eps);
#pragma omp parallel for schedule(static) if (N * C > kParallelMin)
  for (int64_t n = 0; n < N; ++n) rstd[n] = forward_row(out + n * C, inp + n * C, weight, C, eps);
}

void add_rmsnorm_forward(float* out, float* rstd, float* sum, const float* add,
                         const float* weight, int64_t N, int64_t C, float eps) {
  PhaseScope phase_scope(Phase::Norm);
  MOETRAIN_CHECK(N >= 0 && C > 0, "add_rmsnorm_forward: need N >= 0 and C > 0, got N={} C={}", N,
                 C);
  MOETRAIN_CHECK(eps >= 0.0f, "add_rmsnorm_forward: eps must be >= 0, got {}", eps);
#pragma omp parallel for schedule(static) if (N * C > kParallelMin)
  for (int64_t n = 0; n < N; ++n)
    rstd[n] = add_forward_row(out + n * C, sum + n * C, add + n * C, weight, C, eps);
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C,
                      const float* residual) {
  PhaseScope phase_scope(Phase::Norm);
  MOETRAIN_CHECK(N >= 0 && C > 0, "rmsnorm_backward: need N >= 0 and C > 0, got N={} C={}", N, C);
  // y_c = w_c x_c r with r = (mean(x²) + eps)^(-1/2) and dr/dx_j = −r³ x_j / C, so
  // dx_j = r w_j dy_j − r³ x_j / C · Σ_c dy_c w_c x_c, and dweight_c += Σ_n dy_nc x_nc r_n, in
  // the same pass over the rows: each chunk of kRowChunk rows sums its rows in order (in double),
  // and the chunks' sums are added in chunk order.
  const int64_t chunks = (N + kRowChunk - 1) / kRowChunk;
  thread_local std::vector<double> partials;
  if (dweight != nullptr) partials.assign(static_cast<std::size_t>(chunks * C), 0.0);
  double* partial = dweight != nullptr ? partials.data() : nullptr;
#pragma omp parallel for schedule(static) if (N * C > kParallelMin)
  for (int64_t k = 0; k < chunks; ++k) {
    for (int64_t n = k * kRowChunk; n < std::min(N, (k + 1) * kRowChunk); ++n)
      backward_row(dinp + n * C, dout + n * C, inp + n * C, weight, rstd[n], C,
                   residual ? residual + n * C : nullptr, partial ? partial + k * C : nullptr);
  }
  if (dweight == nullptr) return;
  if (N == 0) {  // no rows: a zero sum, still added (−0 becomes +0, as the device kernel does)
    for (int64_t c = 0; c < C; ++c) dweight[c] += 0.0f;
    return;
  }
  const int64_t blocks = (C + kAddCols - 1) / kAddCols;
#pragma omp parallel for schedule(static) if (chunks * C > kParallelMin && blocks > 1)
  for (int64_t b = 0; b < blocks; ++b)
    add_partials(dweight, partial, chunks, C, b * kAddCols, std::min(C, (b + 1) * kAddCols));
}

}  // namespace moetrain
