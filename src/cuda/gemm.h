// Matrix products on the device through cuBLAS, with the row-major conventions of
// kernels/gemm.h: C (M, N) = op(A) (M, K) · op(B) (K, N) [+ C], A stored (M, K) for Trans::N or
// (K, M) for Trans::T, likewise B. f32 operands and accumulation: true f32 by default (a product
// differs from the CPU's by summation order only), TF32 operands on the tensor cores where the
// context's math mode allows it (train.precision = tf32).
#pragma once
#include <cstdint>

#include "cuda/device.h"
#include "kernels/gemm.h"

namespace moetrain::cuda {

void gemm(const Context& ctx, Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const float* A,
          const float* B, float* C, bool accumulate);

// A fully connected layer with weights stored (OC, IC): out (N, OC) = inp (N, IC) · Wᵀ.
inline void linear_forward(const Context& ctx, float* out, const float* inp, const float* w,
                           int64_t N, int64_t IC, int64_t OC) {
  gemm(ctx, Trans::N, Trans::T, N, OC, IC, inp, w, out, false);
}
// dinp (N, IC) = (or += with acc) dout (N, OC) · W, skipped when dinp is null;
// dweight (OC, IC) += doutᵀ · inp.
inline void linear_backward(const Context& ctx, float* dinp, bool acc, float* dweight,
                            const float* dout, const float* inp, const float* w, int64_t N,
                            int64_t IC, int64_t OC) {
  if (dinp) gemm(ctx, Trans::N, Trans::N, N, IC, OC, dout, w, dinp, acc);
  gemm(ctx, Trans::T, Trans::N, OC, IC, N, dout, inp, dweight, true);
}

}  // namespace moetrain::cuda
