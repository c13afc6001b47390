// f32 → bf16 rounding of GEMM operands (kernels.h, "convert.cu").
#include <algorithm>

#include "cuda/bf16.cuh"
#include "cuda/device.h"
#include "cuda/kernels.h"

namespace moetrain::cuda {

namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 1u << 16;

// Four elements a thread where the pointers allow it (a float4 in, two packed pairs out).
__global__ void to_bf16_kernel(uint16_t* __restrict__ out, const float* __restrict__ in,
                               int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool vec = (reinterpret_cast<uintptr_t>(in) % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(out) % 8 == 0);
  if (vec) {
    const int64_t n4 = n / 4;
    for (int64_t i = first; i < n4; i += stride) {
      const float4 x = reinterpret_cast<const float4*>(in)[i];
      uint2 r;
      r.x = static_cast<uint32_t>(bf16_bits(x.x)) | (static_cast<uint32_t>(bf16_bits(x.y)) << 16);
      r.y = static_cast<uint32_t>(bf16_bits(x.z)) | (static_cast<uint32_t>(bf16_bits(x.w)) << 16);
      reinterpret_cast<uint2*>(out)[i] = r;
    }
    for (int64_t i = 4 * n4 + first; i < n; i += stride) out[i] = bf16_bits(in[i]);
    return;
  }
  for (int64_t i = first; i < n; i += stride) out[i] = bf16_bits(in[i]);
}

}  // namespace

void to_bf16(uint16_t* out, const float* in, int64_t n, cudaStream_t s) {
  MOETRAIN_CHECK(n >= 0, "cuda::to_bf16: n = {}", n);
  if (n == 0) return;
  const unsigned blocks = std::min(blocks_for((n + 3) / 4, kThreads), kMaxBlocks);
  to_bf16_kernel<<<blocks, kThreads, 0, s>>>(out, in, n);
  MOETRAIN_CUDA_LAUNCHED();
}

}  // namespace moetrain::cuda
