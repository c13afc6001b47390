// Device elementwise kernels (kernels.h, "activation.cu"): SwiGLU forward and backward as
// kernels/activation.cpp writes them (sigmoid = 1 / (1 + exp(−x)) in float, expf here, so they
// agree with the CPU to a few ulp), and the residual add, which is bitwise the CPU's a + b.

#include <cstdint>

#include "cuda/device.h"
#include "cuda/kernels.h"

namespace moetrain::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

__device__ __forceinline__ int64_t global_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// One thread per element throughout; no element is read by another thread, so in-place calls
// (out = a or b) are safe.
__global__ void swiglu_forward_kernel(float* out, const float* a, const float* b, int64_t n) {
  const int64_t i = global_index();
  if (i >= n) return;
  const float x = a[i];
  out[i] = x * sigmoid(x) * b[i];
}

__global__ void swiglu_backward_kernel(float* da, float* db, const float* dout, const float* a,
                                       const float* b, int64_t n) {
  const int64_t i = global_index();
  if (i >= n) return;
  const float x = a[i], y = b[i], g = dout[i];
  const float s = sigmoid(x);
  // silu'(x) = σ(x)·(1 + x·(1 − σ(x))), in the CPU's order.
  da[i] = g * y * s * (1.0f + x * (1.0f - s));
  db[i] = g * (x * s);
}

__global__ void add_kernel(float* out, const float* a, const float* b, int64_t n) {
  const int64_t i = global_index();
  if (i >= n) return;
  out[i] = __fadd_rn(a[i], b[i]);
}

void check_n(const char* fn, int64_t n) {
  MOETRAIN_CHECK(n >= 0, "{}: element count {} is negative", fn, n);
  MOETRAIN_CHECK(n / kThreads < 0x7fffffff, "{}: {} elements exceed the grid", fn, n);
}

}  // namespace

void swiglu_forward(float* out, const float* a, const float* b, int64_t n, cudaStream_t s) {
  check_n("cuda::swiglu_forward", n);
  if (n == 0) return;
  swiglu_forward_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(out, a, b, n);
  MOETRAIN_CUDA_LAUNCHED();
}

void swiglu_backward(float* da, float* db, const float* dout, const float* a, const float* b,
                     int64_t n, cudaStream_t s) {
  check_n("cuda::swiglu_backward", n);
  if (n == 0) return;
  swiglu_backward_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(da, db, dout, a, b, n);
  MOETRAIN_CUDA_LAUNCHED();
}

void add(float* out, const float* a, const float* b, int64_t n, cudaStream_t s) {
  check_n("cuda::add", n);
  if (n == 0) return;
  add_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(out, a, b, n);
  MOETRAIN_CUDA_LAUNCHED();
}

}  // namespace moetrain::cuda
