// Device rotary position embedding (kernels.h, "rope.cu") in the Hugging Face "rotate_half"
// convention of kernels/rope.h, with the CPU's numerics: inv_freq is computed on the host by the
// very expression of kernels/rope.cpp (so it is bitwise the CPU's), the angle is rounded to float,
// its cos/sin come from double, and the rotation is the CPU's uncontracted float arithmetic.

#include <cmath>
#include <cstdint>

#include "cuda/device.h"
#include "cuda/kernels.h"

namespace moetrain::cuda {

namespace {

constexpr int kThreads = 256;
// inv_freq travels as a kernel argument (2 KiB), which bounds the head size.
constexpr int64_t kMaxHalf = 512;

struct InvFreq {
  float v[kMaxHalf];  // (HS/2)
};

// One thread per (token n, pair index i) (grid over N·HS/2): it computes that pair's cos/sin once
// and rotates the pair (i, i + HS/2) of every head. Each pair is read before it is written by the
// same thread, so out may alias inp. sign = −1 rotates backwards (the backward pass).
__global__ void rope_kernel(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                            int64_t HS, InvFreq inv_freq, float sign) {
  const int64_t half = HS / 2;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= N * half) return;
  const int64_t n = t / half, i = t - n * half;
  // CPU: double(float(pos) * inv_freq[i]), then float(cos), float(sin) of that double.
  const double angle = static_cast<double>(__fmul_rn(static_cast<float>(pos[n]), inv_freq.v[i]));
  double sin_d, cos_d;
  sincos(angle, &sin_d, &cos_d);
  const float c = static_cast<float>(cos_d);
  const float s = __fmul_rn(sign, static_cast<float>(sin_d));
  for (int64_t h = 0; h < NH; ++h) {
    const int64_t b = (n * NH + h) * HS;
    const float x1 = inp[b + i], x2 = inp[b + i + half];
    // CPU: x1 * c - x2 * s  and  x2 * c + x1 * s.
    out[b + i] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    out[b + i + half] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
  }
}

void rope_launch(const char* fn, float* out, const float* inp, const int32_t* pos, int64_t N,
                 int64_t NH, int64_t HS, float theta, float sign, cudaStream_t s) {
  MOETRAIN_CHECK(theta > 0.0f && std::isfinite(theta), "{}: theta must be finite and > 0, got {}",
                 fn, theta);
  MOETRAIN_CHECK(N >= 0 && NH >= 0, "{}: need N >= 0 and NH >= 0, got N={} NH={}", fn, N, NH);
  MOETRAIN_CHECK(HS > 0 && HS % 2 == 0, "{}: head size must be even and > 0, got HS={}", fn, HS);
  MOETRAIN_CHECK(HS / 2 <= kMaxHalf, "{}: head size {} above the device kernel's {}", fn, HS,
                 2 * kMaxHalf);
  const int64_t half = HS / 2;
  if (N == 0 || NH == 0) return;
  MOETRAIN_CHECK(N * half / kThreads < 0x7fffffff, "{}: N={} HS={} exceed the grid", fn, N, HS);
  // kernels/rope.cpp's inv_freq_f32, expression for expression (std::pow on floats is powf).
  InvFreq inv_freq{};
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(HS);
    inv_freq.v[i] = 1.0f / std::pow(theta, exponent);
  }
  rope_kernel<<<blocks_for(N * half, kThreads), kThreads, 0, s>>>(out, inp, pos, N, NH, HS,
                                                                  inv_freq, sign);
  MOETRAIN_CUDA_LAUNCHED();
}

}  // namespace

// Positions are not checked against [0, 2^24) here (that needs the ids on the host); outside it
// the angle is still finite but no longer the CPU's.
void rope_forward(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                  int64_t HS, float theta, cudaStream_t s) {
  rope_launch("cuda::rope_forward", out, inp, pos, N, NH, HS, theta, 1.0f, s);
}

void rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t N, int64_t NH,
                   int64_t HS, float theta, cudaStream_t s) {
  rope_launch("cuda::rope_backward", dinp, dout, pos, N, NH, HS, theta, -1.0f, s);
}

}  // namespace moetrain::cuda
