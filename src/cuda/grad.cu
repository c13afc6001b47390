// The device gradient's reductions and scaling for the one update step (optim/update.h): a
// non-finite count and Σg² in double over fixed blocks of the flat buffer, each block summed in a
// fixed order (threads' strided partial sums, then a fixed tree), the block partials then summed
// by the host in block order, so the norm is the same on every run; and g *= factor.
#include <algorithm>
#include <vector>

#include "cuda/device.h"
#include "cuda/kernels.h"

namespace moetrain::cuda {

namespace {

constexpr int kThreads = 256;

// partial_sq (blocks), partial_bad (blocks): block b covers [b·span, min(n, (b+1)·span)).
__global__ void grad_sums_kernel(const float* g, int64_t n, int64_t span, double* partial_sq,
                                 unsigned long long* partial_bad) {
  __shared__ double sq[kThreads];
  __shared__ unsigned long long bad[kThreads];
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * span;
  const int64_t hi = lo + span < n ? lo + span : n;
  double s = 0;
  unsigned long long b = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const float x = g[i];
    if (!isfinite(x)) {
      ++b;
    } else {
      s += static_cast<double>(x) * static_cast<double>(x);
    }
  }
  sq[threadIdx.x] = s;
  bad[threadIdx.x] = b;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) {
      sq[threadIdx.x] += sq[threadIdx.x + w];
      bad[threadIdx.x] += bad[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partial_sq[blockIdx.x] = sq[0];
    partial_bad[blockIdx.x] = bad[0];
  }
}

__global__ void scale_kernel(float* g, int64_t n, float factor) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    g[i] = __fmul_rn(g[i], factor);
}

}  // namespace

GradSums grad_sums(const float* g, int64_t n, cudaStream_t s) {
  MOETRAIN_CHECK(n >= 0, "cuda::grad_sums: n = {}", n);
  GradSums out;
  if (n == 0) return out;
  // A fixed span per block (not a fixed block count): the partials depend on n alone.
  constexpr int64_t kSpan = int64_t{1} << 16;
  const int64_t blocks = (n + kSpan - 1) / kSpan;
  DeviceBuffer<double> sq(blocks);
  DeviceBuffer<unsigned long long> bad(blocks);
  grad_sums_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(g, n, kSpan, sq.data(),
                                                                      bad.data());
  MOETRAIN_CUDA_LAUNCHED();
  std::vector<double> hsq(static_cast<std::size_t>(blocks));
  std::vector<unsigned long long> hbad(hsq.size());
  MOETRAIN_CUDA_CHECK(cudaStreamSynchronize(s));
  sq.download(hsq.data(), blocks);
  bad.download(hbad.data(), blocks);
  for (int64_t b = 0; b < blocks; ++b) out.sum_squares += hsq[b], out.non_finite += hbad[b];
  return out;
}

void scale(float* g, int64_t n, float factor, cudaStream_t s) {
  MOETRAIN_CHECK(n >= 0, "cuda::scale: n = {}", n);
  if (n == 0) return;
  const unsigned blocks = std::min(blocks_for(n, kThreads), 1u << 16);
  scale_kernel<<<blocks, kThreads, 0, s>>>(g, n, factor);
  MOETRAIN_CUDA_LAUNCHED();
}

}  // namespace moetrain::cuda
