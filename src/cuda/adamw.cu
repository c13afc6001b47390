// The device AdamW update: one fused elementwise pass over params and both moments, with the float
// operations of optim/adamw.cpp in the same order, each rounded on its own (the __f*_rn intrinsics
// keep nvcc from contracting a multiply and an add into an FMA), so a step is bitwise the CPU's.

#include "cuda/bf16.cuh"
#include "cuda/device.h"
#include "cuda/kernels.h"

#include <algorithm>

namespace moetrain::cuda {

namespace {

constexpr int kThreads = 256;
// Grid-stride loops cover any n with at most this many blocks (many waves of an H100 already).
constexpr unsigned kMaxBlocks = 1u << 16;

// params, exp_avg, exp_avg_sq, grads (n); kCopy: also params_bf16 (n). The body is adamw_segment of optim/adamw.cpp line by
// line; std::sqrt and `/` there are IEEE-correctly rounded, as __fsqrt_rn and __fdiv_rn are.
template <bool kDecay, bool kCopy>
__global__ void adamw_kernel(float* params, float* exp_avg, float* exp_avg_sq, const float* grads,
                             int64_t n, AdamWScalars a, uint16_t* params_bf16) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float param = params[i];
    if constexpr (kDecay) param = __fmul_rn(param, a.decay);
    const float grad = grads[i];
    const float mi = __fadd_rn(__fmul_rn(a.beta1, exp_avg[i]), __fmul_rn(a.one_minus_beta1, grad));
    const float vi = __fadd_rn(__fmul_rn(a.beta2, exp_avg_sq[i]),
                               __fmul_rn(a.one_minus_beta2, __fmul_rn(grad, grad)));
    exp_avg[i] = mi;
    exp_avg_sq[i] = vi;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), a.bias2_sqrt), a.eps);
    const float updated = __fsub_rn(param, __fmul_rn(a.step_size, __fdiv_rn(mi, denom)));
    params[i] = updated;
    if constexpr (kCopy) params_bf16[i] = bf16_bits(updated);
  }
}

}  // namespace

void adamw_step(float* params, float* exp_avg, float* exp_avg_sq, const float* grads, int64_t n,
                bool decay, const AdamWScalars& a, cudaStream_t s, uint16_t* params_bf16) {
  MOETRAIN_CHECK(n >= 0, "cuda::adamw_step: n = {}", n);
  if (n == 0) return;
  const unsigned blocks = std::min(blocks_for(n, kThreads), kMaxBlocks);
  auto launch = [&](auto kernel) {
    kernel<<<blocks, kThreads, 0, s>>>(params, exp_avg, exp_avg_sq, grads, n, a, params_bf16);
  };
  if (decay) {
    params_bf16 ? launch(adamw_kernel<true, true>) : launch(adamw_kernel<true, false>);
  } else {
    params_bf16 ? launch(adamw_kernel<false, true>) : launch(adamw_kernel<false, false>);
  }
  MOETRAIN_CUDA_LAUNCHED();
}

}  // namespace moetrain::cuda
