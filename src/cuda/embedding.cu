// Device token embedding (kernels.h, "embedding.cu"): the row gather of the forward and the
// scatter-add of the backward, the latter without atomics and bitwise the CPU's
// (kernels/embedding.cpp): each table row adds its tokens' rows one at a time in token order.

#include <cstdint>

#include "cuda/device.h"
#include "cuda/kernels.h"

namespace moetrain::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// The backward tests this many ids per thread between barriers.
constexpr int kIdsPerThread = 8;
constexpr int64_t kChunk = int64_t{kThreads} * kIdsPerThread;
static_assert(kThreads % 32 == 0 && kWarps <= 32);

// out (N, C) = table[ids];  one thread per output element.
__global__ void embedding_forward_kernel(float* out, const int32_t* ids, const float* table,
                                         int64_t N, int64_t C, int64_t V) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  const int64_t n = i / C, c = i - n * C;
  const int64_t id = ids[n];
  // The host cannot validate ids without a sync; a bad id gives a NaN row instead of a wild read.
  out[i] = (id >= 0 && id < V) ? table[id * C + c] : __int_as_float(0x7fc00000);
}

// One block per table row v (grid V). The block walks the ids in chunks of kChunk: each thread
// tests kIdsPerThread of them (thread t, sub-chunk k: token base + k·kThreads + t, so a sub-chunk
// is kThreads consecutive tokens), and one barrier skips the chunk when no thread found v. Else,
// sub-chunk by sub-chunk, the positions holding v are compacted into shared memory in token order
// (ballot + per-warp offsets), and each thread adds those rows into the columns it owns
// (c ≡ threadIdx.x mod kThreads), one row at a time. A column is only ever touched by one thread
// and rows arrive in token order, so the float additions are exactly the CPU's `row[c] += d[c]`
// sequence. An id outside [0, V) matches no block and is skipped.
__global__ void __launch_bounds__(kThreads)
    embedding_backward_kernel(float* dtable, const float* dout, const int32_t* ids, int64_t N,
                              int64_t C) {
  __shared__ int64_t rows[kThreads];  // this sub-chunk's positions of id v, in token order
  __shared__ int warp_offset[kWarps];
  __shared__ int sub_count;
  const int64_t v = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* drow = dtable + v * C;
  for (int64_t base = 0; base < N; base += kChunk) {
    unsigned hit_bits = 0;
    for (int k = 0; k < kIdsPerThread; ++k) {
      const int64_t n = base + int64_t{k} * kThreads + threadIdx.x;
      if (n < N && ids[n] == v) hit_bits |= 1u << k;
    }
    // Most chunks hold no v at all; base is block-uniform, so every thread reaches this barrier
    // and the ones below.
    if (!__syncthreads_or(hit_bits != 0)) continue;
    for (int k = 0; k < kIdsPerThread; ++k) {
      const bool hit = (hit_bits >> k) & 1u;
      const unsigned mask = __ballot_sync(0xffffffffu, hit);
      if (lane == 0) warp_offset[warp] = __popc(mask);
      __syncthreads();
      if (threadIdx.x == 0) {
        int total = 0;
        for (int w = 0; w < kWarps; ++w) {
          const int count = warp_offset[w];
          warp_offset[w] = total;
          total += count;
        }
        sub_count = total;
      }
      __syncthreads();
      if (hit) {
        rows[warp_offset[warp] + __popc(mask & ((1u << lane) - 1u))] =
            base + int64_t{k} * kThreads + threadIdx.x;
      }
      __syncthreads();
      const int count = sub_count;
      if (count > 0) {
        for (int64_t c = threadIdx.x; c < C; c += kThreads) {
          float acc = drow[c];
          for (int j = 0; j < count; ++j) acc = __fadd_rn(acc, dout[rows[j] * C + c]);
          drow[c] = acc;
        }
      }
      // rows, warp_offset and sub_count are rewritten by the next sub-chunk.
      __syncthreads();
    }
  }
}

}  // namespace

void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                       int64_t V, cudaStream_t s) {
  MOETRAIN_CHECK(N >= 0 && C >= 0 && V > 0,
                 "cuda::embedding_forward: need N >= 0, C >= 0, V > 0, got N={} C={} V={}", N, C,
                 V);
  if (N == 0 || C == 0) return;
  MOETRAIN_CHECK(N * C / kThreads < 0x7fffffff,
                 "cuda::embedding_forward: N={} C={} exceed the grid", N, C);
  embedding_forward_kernel<<<blocks_for(N * C, kThreads), kThreads, 0, s>>>(out, ids, table, N, C,
                                                                            V);
  MOETRAIN_CUDA_LAUNCHED();
}

void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C,
                        int64_t V, cudaStream_t s) {
  MOETRAIN_CHECK(N >= 0 && C >= 0 && V > 0,
                 "cuda::embedding_backward: need N >= 0, C >= 0, V > 0, got N={} C={} V={}", N, C,
                 V);
  MOETRAIN_CHECK(V <= 0x7fffffff, "cuda::embedding_backward: V={} exceeds the grid", V);
  if (N == 0 || C == 0) return;
  embedding_backward_kernel<<<static_cast<unsigned>(V), kThreads, 0, s>>>(dtable, dout, ids, N, C);
  MOETRAIN_CUDA_LAUNCHED();
}

}  // namespace moetrain::cuda
