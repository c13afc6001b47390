// Matrix products on the device through cuBLAS, with the row-major conventions of
// kernels/gemm.h: C (M, N) = op(A) (M, K) · op(B) (K, N) [+ C], A stored (M, K) for Trans::N or
// (K, M) for Trans::T, likewise B. Accumulation is f32; the operands are what the context's
// gemm_mode() says: true f32 (a product differs from the CPU's by summation order only), TF32 on
// the tensor cores (train.precision = tf32), or bf16 (train.precision = bf16: each operand rounded
// to bf16 as the CPU rounds it, weights read from the context's weight copy). `exact` keeps f32
// operands whatever the mode (the router's GEMMs, f32 on the CPU too).
#pragma once
#include <cstdint>

#include "cuda/device.h"
#include "kernels/gemm.h"

namespace moetrain::cuda {

void gemm(const Context& ctx, Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const float* A,
          const float* B, float* C, bool accumulate, bool exact = false);

// How often this process's bf16 GEMMs chose a cuBLASLt algorithm and how often they reused one
// (cuda/gemm.cpp).
struct GemmPlanStats {
  int64_t chosen = 0, reused = 0;
};
GemmPlanStats gemm_plan_stats();

// A fully connected layer with weights stored (OC, IC): out (N, OC) = inp (N, IC) · Wᵀ.
inline void linear_forward(const Context& ctx, float* out, const float* inp, const float* w,
                           int64_t N, int64_t IC, int64_t OC, bool exact = false) {
  gemm(ctx, Trans::N, Trans::T, N, OC, IC, inp, w, out, false, exact);
}
// dinp (N, IC) = (or += with acc) dout (N, OC) · W, skipped when dinp is null;
// dweight (OC, IC) += doutᵀ · inp.
inline void linear_backward(const Context& ctx, float* dinp, bool acc, float* dweight,
                            const float* dout, const float* inp, const float* w, int64_t N,
                            int64_t IC, int64_t OC, bool exact = false) {
  if (dinp) gemm(ctx, Trans::N, Trans::N, N, IC, OC, dout, w, dinp, acc, exact);
  gemm(ctx, Trans::T, Trans::N, OC, IC, N, dout, inp, dweight, true, exact);
}

}  // namespace moetrain::cuda
