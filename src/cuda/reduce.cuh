// Warp and block reductions of the device kernels, each in a fixed order (an xor butterfly, then
// the warps' results by warp 0), so every lane gets the same bits and a run is repeatable.
// Included by .cu files only.
#pragma once
#include <cmath>

namespace moetrain::cuda {

constexpr unsigned kFullWarp = 0xffffffffu;

// Butterflies: every lane ends with the same bits (a + b == b + a and max are commutative).
__device__ __forceinline__ double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = __dadd_rn(v, __shfl_xor_sync(kFullWarp, v, offset));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullWarp, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(kFullWarp, v, offset));
  return v;
}

namespace detail {
// The block's reduction of v by `warp_op`, with `identity` for the missing warps, returned to
// every thread. All threads of the block call it; it starts and ends with barriers, so the
// caller's reads before it are done when it returns and its shared memory may be reused.
template <class T, class WarpOp>
__device__ __forceinline__ T block_reduce(T v, T identity, WarpOp warp_op) {
  __shared__ T warp_vals[32];
  __shared__ T total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_op(v);
  if (lane == 0) warp_vals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    T w = lane < warps ? warp_vals[lane] : identity;
    w = warp_op(w);
    if (lane == 0) total = w;
  }
  __syncthreads();
  const T result = total;
  __syncthreads();
  return result;
}
}  // namespace detail

// Σ v over the block (blockDim.x a multiple of 32), in double.
__device__ __forceinline__ double block_sum(double v) {
  return detail::block_reduce(v, 0.0, [](double x) { return warp_sum(x); });
}
// max v over the block.
__device__ __forceinline__ float block_max(float v) {
  return detail::block_reduce(v, -INFINITY, [](float x) { return warp_max(x); });
}

}  // namespace moetrain::cuda
