// Device versions of moe/dispatch.h's data movements over a DispatchLayout copied to the device:
// permute (token rows into the expert-grouped buffer) and combine (weighted expert outputs back
// per token), forward and backward. Each output element is written by one thread, summing the
// token's slots in slot order with uncontracted float operations, so permute_backward,
// combine_forward and combine_backward's dy are bitwise the CPU's; combine_backward's dweight is a
// C-term dot product reduced by one warp in a fixed order.

#include "cuda/device.h"
#include "cuda/kernels.h"

#include <algorithm>

namespace moetrain::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
// Grid-stride loops cover any n with at most this many blocks (many waves of an H100 already).
constexpr unsigned kMaxBlocks = 1u << 16;

unsigned grid_for(int64_t n) { return std::min(blocks_for(n, kThreads), kMaxBlocks); }

__device__ int64_t thread_index() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ int64_t thread_count() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// xp (R, C) from inp (N, C); one thread per element of xp.
__global__ void permute_forward_kernel(float* xp, const float* inp, const int32_t* row_token,
                                       int64_t R, int64_t C) {
  const int64_t n = R * C;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t r = i / C, c = i - r * C;
    xp[i] = inp[static_cast<int64_t>(row_token[r]) * C + c];
  }
}

// dinp (N, C); one thread per element, adding the token's rows in slot order like the CPU loop
// (which starts from 0.0f when not accumulating: 0 + (−0) is +0, so the start value matters).
__global__ void permute_backward_kernel(float* dinp, const float* dxp, const int32_t* slot_row,
                                        int64_t N, int64_t S, int64_t C, bool accumulate) {
  const int64_t n = N * C;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t t = i / C, c = i - t * C;
    float acc = accumulate ? dinp[i] : 0.0f;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t row = slot_row[t * S + s];
      if (row < 0) continue;
      acc = __fadd_rn(acc, dxp[row * C + c]);
    }
    dinp[i] = acc;
  }
}

// out (N, C); as permute_backward with each row weighted. The product is rounded before the add
// (no FMA), as the CPU's `o += w * y` is compiled without contraction.
__global__ void combine_forward_kernel(float* out, const float* y, const int32_t* slot_row,
                                       const float* row_weight, int64_t N, int64_t S, int64_t C,
                                       bool accumulate) {
  const int64_t n = N * C;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t t = i / C, c = i - t * C;
    float acc = accumulate ? out[i] : 0.0f;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t row = slot_row[t * S + s];
      if (row < 0) continue;
      acc = __fadd_rn(acc, __fmul_rn(row_weight[row], y[row * C + c]));
    }
    out[i] = acc;
  }
}

// One warp per slot (t, s): its lanes stride over the C columns (coalesced), writing dy's row and
// summing their share of dout[t]·y[row]; then a fixed shuffle tree. Every branch depends on the
// slot only, so a warp never diverges around the shuffles.
__global__ void combine_backward_kernel(float* dy, float* dweight, const float* dout,
                                        const float* y, const int32_t* slot_row,
                                        const float* row_weight, int64_t N, int64_t S,
                                        int64_t C) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t first_warp = thread_index() / 32;
  const int64_t warps = thread_count() / 32;
  const int64_t slots = N * S;
  for (int64_t slot = first_warp; slot < slots; slot += warps) {
    const int64_t row = slot_row[slot];
    if (row < 0) {
      if (lane == 0) dweight[slot] = 0.0f;
      continue;
    }
    const int64_t t = slot / S;
    const float* g = dout + t * C;
    const float* yr = y + row * C;
    float* dyr = dy + row * C;
    const float w = row_weight[row];
    float dot = 0.0f;
    for (int64_t c = lane; c < C; c += 32) {
      const float gc = g[c];
      dyr[c] = __fmul_rn(w, gc);
      dot = __fmaf_rn(gc, yr[c], dot);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      dot = __fadd_rn(dot, __shfl_down_sync(0xffffffffu, dot, offset));
    }
    if (lane == 0) dweight[slot] = dot;
  }
}

}  // namespace

void permute_forward(float* xp, const float* inp, const int32_t* row_token, int64_t R, int64_t C,
                     cudaStream_t s) {
  MOETRAIN_CHECK(R >= 0 && C >= 0, "cuda::permute_forward: R = {}, C = {}", R, C);
  if (R * C == 0) return;
  permute_forward_kernel<<<grid_for(R * C), kThreads, 0, s>>>(xp, inp, row_token, R, C);
  MOETRAIN_CUDA_LAUNCHED();
}

void permute_backward(float* dinp, const float* dxp, const int32_t* slot_row, int64_t N, int64_t S,
                      int64_t C, bool accumulate, cudaStream_t s) {
  MOETRAIN_CHECK(N >= 0 && S >= 0 && C >= 0, "cuda::permute_backward: N = {}, S = {}, C = {}", N,
                 S, C);
  if (N * C == 0) return;
  permute_backward_kernel<<<grid_for(N * C), kThreads, 0, s>>>(dinp, dxp, slot_row, N, S, C,
                                                               accumulate);
  MOETRAIN_CUDA_LAUNCHED();
}

void combine_forward(float* out, const float* y, const int32_t* slot_row, const float* row_weight,
                     int64_t N, int64_t S, int64_t C, bool accumulate, cudaStream_t s) {
  MOETRAIN_CHECK(N >= 0 && S >= 0 && C >= 0, "cuda::combine_forward: N = {}, S = {}, C = {}", N,
                 S, C);
  if (N * C == 0) return;
  combine_forward_kernel<<<grid_for(N * C), kThreads, 0, s>>>(out, y, slot_row, row_weight, N, S,
                                                              C, accumulate);
  MOETRAIN_CUDA_LAUNCHED();
}

void combine_backward(float* dy, float* dweight, const float* dout, const float* y,
                      const int32_t* slot_row, const float* row_weight, int64_t N, int64_t S,
                      int64_t C, cudaStream_t s) {
  MOETRAIN_CHECK(N >= 0 && S >= 0 && C >= 0, "cuda::combine_backward: N = {}, S = {}, C = {}", N,
                 S, C);
  // With C = 0 the launch still runs: dweight gets the empty dot product, 0.
  const int64_t slots = N * S;
  if (slots == 0) return;
  const unsigned blocks = std::min(blocks_for(slots, kWarpsPerBlock), kMaxBlocks);
  combine_backward_kernel<<<blocks, kThreads, 0, s>>>(dy, dweight, dout, y, slot_row, row_weight,
                                                      N, S, C);
  MOETRAIN_CUDA_LAUNCHED();
}

}  // namespace moetrain::cuda
