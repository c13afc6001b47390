// Device fused softmax + cross-entropy (kernels.h, "softmax.cu") with the numerics of
// kernels/softmax.cpp: row max, Σ exp(x − max) of float terms summed in double, lse and the loss
// from the double log-sum-exp; the backward recomputes the probabilities from the float lse.
// Rows with target −1 are ignored (loss 0, gradient 0).

#include <cmath>
#include <cstdint>

#include "cuda/device.h"
#include "cuda/kernels.h"
#include "cuda/reduce.cuh"

namespace moetrain::cuda {

namespace {

constexpr int kRowThreads = 512;  // a block per row of the forward: V is the vocabulary
constexpr int kThreads = 256;     // a thread per element of the backward
static_assert(kRowThreads % 32 == 0 && kRowThreads <= 1024);

// The device cannot throw: a target outside [−1, V) turns its row's outputs into NaN.
__device__ __forceinline__ float quiet_nan() {
  return __int_as_float(0x7fc00000);
}

// One block per row (grid N). fmaxf skips NaN as the CPU's std::max(m, x) does.
__global__ void __launch_bounds__(kRowThreads)
    softmax_xent_forward_kernel(float* losses, float* lse, const float* logits,
                                const int32_t* targets, int64_t V) {
  const int64_t n = blockIdx.x;
  const float* x = logits + n * V;
  float m = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += kRowThreads) m = fmaxf(m, x[v]);
  m = block_max(m);
  double sum = 0.0;
  for (int64_t v = threadIdx.x; v < V; v += kRowThreads) {
    sum = __dadd_rn(sum, static_cast<double>(expf(x[v] - m)));
  }
  sum = block_sum(sum);
  if (threadIdx.x != 0) return;
  const double l = __dadd_rn(static_cast<double>(m), log(sum));
  lse[n] = static_cast<float>(l);
  const int32_t t = targets[n];
  float loss = 0.0f;
  if (t != -1) {
    // The loss comes from the double lse, as on the CPU.
    loss = (t >= 0 && t < V) ? static_cast<float>(__dsub_rn(l, static_cast<double>(x[t])))
                             : quiet_nan();
  }
  losses[n] = loss;
}

// One thread per element (grid over N·V). dlogits may alias logits: each element is read and then
// written by the same thread, and the target's −g is folded into that same thread's write.
__global__ void softmax_xent_backward_kernel(float* dlogits, const float* dlosses,
                                             const float* logits, const float* lse,
                                             const int32_t* targets, int64_t N, int64_t V) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * V) return;
  const int64_t n = i / V, v = i - n * V;
  const int32_t t = targets[n];
  float d = 0.0f;
  if (t != -1) {
    if (t >= 0 && t < V) {
      const float g = dlosses[n];
      // CPU: dx = g * exp(x - l), then dx[t] -= g.
      d = __fmul_rn(g, expf(__fsub_rn(logits[i], lse[n])));
      if (v == t) d = __fsub_rn(d, g);
    } else {
      d = quiet_nan();
    }
  }
  dlogits[i] = d;
}

void check_shape(const char* fn, int64_t N, int64_t V) {
  MOETRAIN_CHECK(N >= 0 && V > 0, "{}: need N >= 0 and V > 0, got N={} V={}", fn, N, V);
}

}  // namespace

void softmax_xent_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                          int64_t N, int64_t V, cudaStream_t s) {
  check_shape("cuda::softmax_xent_forward", N, V);
  MOETRAIN_CHECK(N <= 0x7fffffff, "cuda::softmax_xent_forward: N={} rows exceed the grid", N);
  if (N == 0) return;
  softmax_xent_forward_kernel<<<static_cast<unsigned>(N), kRowThreads, 0, s>>>(losses, lse, logits,
                                                                               targets, V);
  MOETRAIN_CUDA_LAUNCHED();
}

void softmax_xent_backward(float* dlogits, const float* dlosses, const float* logits,
                           const float* lse, const int32_t* targets, int64_t N, int64_t V,
                           cudaStream_t s) {
  check_shape("cuda::softmax_xent_backward", N, V);
  if (N == 0) return;
  MOETRAIN_CHECK(N * V / kThreads < 0x7fffffff,
                 "cuda::softmax_xent_backward: N={} V={} exceed the grid", N, V);
  softmax_xent_backward_kernel<<<blocks_for(N * V, kThreads), kThreads, 0, s>>>(
      dlogits, dlosses, logits, lse, targets, N, V);
  MOETRAIN_CUDA_LAUNCHED();
}

}  // namespace moetrain::cuda
