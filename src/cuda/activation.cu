// Device elementwise kernels (kernels.h, "activation.cu"): SwiGLU forward and backward as
// kernels/activation.cpp writes them (sigmoid = 1 / (1 + exp(−x)) in float, expf here, so they
// agree with the CPU to a few ulp), and the residual add, which is bitwise the CPU's a + b. With
// bf16 GEMMs the SwiGLU kernels also write their outputs' bf16 copies for the GEMMs that read
// them (cuda/bf16.cuh's rounding), and the backward's f32 outputs are then not written at all.

#include <cstdint>

#include "cuda/bf16.cuh"
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
__global__ void swiglu_forward_kernel(float* out, uint16_t* out16, const float* a, const float* b,
                                      int64_t n) {
  const int64_t i = global_index();
  if (i >= n) return;
  const float x = a[i];
  const float o = x * sigmoid(x) * b[i];
  out[i] = o;
  if (out16) out16[i] = bf16_bits(o);
}

__global__ void swiglu_backward_kernel(float* da, float* db, uint16_t* da16, uint16_t* db16,
                                       const float* dout, const float* a, const float* b,
                                       int64_t n) {
  const int64_t i = global_index();
  if (i >= n) return;
  const float x = a[i], y = b[i], g = dout[i];
  const float s = sigmoid(x);
  // silu'(x) = σ(x)·(1 + x·(1 − σ(x))), in the CPU's order.
  const float dx = g * y * s * (1.0f + x * (1.0f - s)), dy = g * (x * s);
  if (da16) {
    da16[i] = bf16_bits(dx);
    db16[i] = bf16_bits(dy);
  } else {
    da[i] = dx;
    db[i] = dy;
  }
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

void swiglu_forward(float* out, const float* a, const float* b, int64_t n, cudaStream_t s,
                    uint16_t* out16) {
  check_n("cuda::swiglu_forward", n);
  if (n == 0) return;
  swiglu_forward_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(out, out16, a, b, n);
  MOETRAIN_CUDA_LAUNCHED();
}

void swiglu_backward(float* da, float* db, const float* dout, const float* a, const float* b,
                     int64_t n, cudaStream_t s, uint16_t* da16, uint16_t* db16) {
  check_n("cuda::swiglu_backward", n);
  MOETRAIN_CHECK(!da16 == !db16, "cuda::swiglu_backward: give both bf16 outputs or neither");
  if (n == 0) return;
  swiglu_backward_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(da, db, da16, db16, dout, a,
                                                                      b, n);
  MOETRAIN_CUDA_LAUNCHED();
}

void add(float* out, const float* a, const float* b, int64_t n, cudaStream_t s) {
  check_n("cuda::add", n);
  if (n == 0) return;
  add_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(out, a, b, n);
  MOETRAIN_CUDA_LAUNCHED();
}

}  // namespace moetrain::cuda
