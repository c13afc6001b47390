// Device causal grouped-query attention (kernels.h, "attention.cu"): the forward pass (out, lse)
// and the flash-style backward pass (dq, dk, dv) of kernels/attention.h, with its layouts and its
// formulas: scores q·k / √HS, query t sees keys 0..t, head h reads kv head h / (NH / NKV).
//
// Every row is owned by one warp: a query row in the forward and dq kernels, a key row of a kv
// head in the dk/dv kernel. The lanes split the head dimension (lane i holds elements i, i + 32,
// ...), so every row read is coalesced. Keys (or queries) go 32 at a time: each score is a warp
// dot product (per-lane sums, then a butterfly) kept by the lane of its position, which then
// computes that position's softmax weight; the weighted sums over the 32 rows follow, each lane
// adding the rows in position order into its share of the accumulator.
// No atomics: every output element is summed by one lane in a fixed order, so runs are bitwise
// repeatable.

#include <cmath>
#include <cstdint>

#include "cuda/device.h"
#include "cuda/kernels.h"
#include "cuda/reduce.cuh"
#include "kernels/attention.h"

namespace moetrain::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 4;  // rows per block
constexpr int kThreads = kWarp * kWarps;
// A lane holds its share of a head-dimension row in registers: HS / 32 floats per accumulator.
constexpr int kMaxHS = 256;
constexpr int kPerLane = kMaxHS / kWarp;
constexpr unsigned kFullMask = 0xffffffffu;

// This lane's share x[i] = row[lane + 32·i] of a head-dimension row.
__device__ __forceinline__ void load_lane(float (&x)[kPerLane], const float* __restrict__ row,
                                          int lane, int HS) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + i * kWarp;
    x[i] = d < HS ? row[d] : 0.0f;
  }
}

// Σ_d x[d]·row[d] with x split over the lanes as load_lane leaves it: each lane sums its share in
// order, the butterfly adds the 32 partial sums. Every lane gets the same value.
__device__ __forceinline__ float warp_dot(const float (&x)[kPerLane],
                                          const float* __restrict__ row, int lane, int HS) {
  float part = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + i * kWarp;
    if (d < HS) part += x[i] * row[d];
  }
  return warp_sum(part);
}

// acc[i] += w · row[lane + 32·i] over this lane's share of the head dimension.
__device__ __forceinline__ void axpy_lane(float (&acc)[kPerLane], float w,
                                          const float* __restrict__ row, int lane, int HS) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + i * kWarp;
    if (d < HS) acc[i] += w * row[d];
  }
}

// One warp per query row; grid covers B·NH·T rows. Online softmax over chunks of 32 keys: lane j
// holds key s0 + j's score and weight, the running max m and sum l are warp-uniform, and out's
// accumulator is rescaled by exp(m_old − m_new) when the max grows. Row index order puts the
// latest queries (the most keys) first so that the long warps start early.
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(float* __restrict__ out, float* __restrict__ lse,
                             const float* __restrict__ q, const float* __restrict__ k,
                             const float* __restrict__ v, int64_t B, int64_t T, int64_t NH,
                             int64_t NKV, int HS, float scale) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp;
  if (row >= B * NH * T) return;  // warp-uniform: the shuffles below see full warps
  const int64_t t = T - 1 - row % T, h = row / T % NH, b = row / T / NH, g = h / (NH / NKV);
  const int64_t q_off = ((b * T + t) * NH + h) * HS;  // (B, T, NH, HS)
  const int64_t kv_step = NKV * HS;                    // between positions of one kv head
  const float* k0 = k + (b * T * NKV + g) * HS;        // key 0 of kv head g
  const float* v0 = v + (b * T * NKV + g) * HS;

  float qx[kPerLane];
  load_lane(qx, q + q_off, lane, HS);
  float acc[kPerLane] = {};  // unnormalised out, relative to exp(m)
  float m = -INFINITY, l = 0.0f;
  for (int64_t s0 = 0; s0 <= t; s0 += kWarp) {
    const int n = static_cast<int>(t - s0 + 1 < kWarp ? t - s0 + 1 : kWarp);  // keys seen, ≥ 1
    float score = -INFINITY;
    for (int j = 0; j < n; ++j) {
      const float sj = warp_dot(qx, k0 + (s0 + j) * kv_step, lane, HS) * scale;
      if (lane == j) score = sj;
    }
    // Lane 0's key is always seen, so m_new is finite for finite inputs.
    const float m_new = fmaxf(m, warp_max(score));
    const float p = lane < n ? expf(score - m_new) : 0.0f;
    const float alpha = expf(m - m_new);  // 0 on the first chunk (m = −inf), 1 if m held
    l = l * alpha + warp_sum(p);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] *= alpha;
    for (int j = 0; j < n; ++j) {
      const float pj = __shfl_sync(kFullMask, p, j);
      axpy_lane(acc, pj, v0 + (s0 + j) * kv_step, lane, HS);
    }
    m = m_new;
  }
  const float inv_l = 1.0f / l;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + i * kWarp;
    if (d < HS) out[q_off + d] = acc[i] * inv_l;
  }
  if (lane == 0) lse[(b * NH + h) * T + t] = m + logf(l);
}

// One warp per query row (same order as the forward). First D_t = Σ dout_t ⊙ out_t for this row,
// kept in D (B, NH, T) for the dk/dv kernel; then dq_t = scale · Σ_{s ≤ t} ds_s · k_s with
// p_s = exp(score_s − lse_t) and ds_s = p_s · (dout_t·v_s − D_t), the CPU's formulas.
__global__ void __launch_bounds__(kThreads)
    attention_dq_kernel(float* __restrict__ dq, float* __restrict__ D,
                        const float* __restrict__ dout, const float* __restrict__ q,
                        const float* __restrict__ k, const float* __restrict__ v,
                        const float* __restrict__ out, const float* __restrict__ lse, int64_t B,
                        int64_t T, int64_t NH, int64_t NKV, int HS, float scale) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp;
  if (row >= B * NH * T) return;  // warp-uniform
  const int64_t t = T - 1 - row % T, h = row / T % NH, b = row / T / NH, g = h / (NH / NKV);
  const int64_t q_off = ((b * T + t) * NH + h) * HS;  // (B, T, NH, HS)
  const int64_t kv_step = NKV * HS;
  const float* k0 = k + (b * T * NKV + g) * HS;
  const float* v0 = v + (b * T * NKV + g) * HS;
  const int64_t lse_at = (b * NH + h) * T + t;  // (B, NH, T)

  float qx[kPerLane], dox[kPerLane];
  load_lane(qx, q + q_off, lane, HS);
  load_lane(dox, dout + q_off, lane, HS);
  const float Dt = warp_dot(dox, out + q_off, lane, HS);
  if (lane == 0) D[lse_at] = Dt;
  const float L = lse[lse_at];

  float acc[kPerLane] = {};  // Σ ds·k, scaled at the end as the CPU does
  for (int64_t s0 = 0; s0 <= t; s0 += kWarp) {
    const int n = static_cast<int>(t - s0 + 1 < kWarp ? t - s0 + 1 : kWarp);  // keys seen
    float score = 0.0f, dp = 0.0f;  // lane j: key s0 + j
    for (int j = 0; j < n; ++j) {
      const float sj = warp_dot(qx, k0 + (s0 + j) * kv_step, lane, HS);
      const float dpj = warp_dot(dox, v0 + (s0 + j) * kv_step, lane, HS);
      if (lane == j) score = sj, dp = dpj;
    }
    const float ds = lane < n ? expf(score * scale - L) * (dp - Dt) : 0.0f;
    for (int j = 0; j < n; ++j) {
      const float dsj = __shfl_sync(kFullMask, ds, j);
      axpy_lane(acc, dsj, k0 + (s0 + j) * kv_step, lane, HS);
    }
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + i * kWarp;
    if (d < HS) dq[q_off + d] = acc[i] * scale;
  }
}

// One warp per key row s of kv head g; grid covers B·NKV·T rows, early keys (seen by the most
// queries) first. Sums over the group's query heads h in order, and within a head over the
// queries t ≥ s in order, 32 queries at a time (lane j computes query t0 + j's p and ds):
//   dv_s = Σ p_ts · dout_t,   dk_s = scale · Σ ds_ts · q_t.
// Needs D (B, NH, T) from attention_dq_kernel, which runs first on the same stream.
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(float* __restrict__ dk, float* __restrict__ dv,
                          const float* __restrict__ dout, const float* __restrict__ q,
                          const float* __restrict__ k, const float* __restrict__ v,
                          const float* __restrict__ lse, const float* __restrict__ D, int64_t B,
                          int64_t T, int64_t NH, int64_t NKV, int HS, float scale) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp;
  if (row >= B * NKV * T) return;  // warp-uniform
  const int64_t s = row % T, g = row / T % NKV, b = row / T / NKV, G = NH / NKV;
  const int64_t kv_off = ((b * T + s) * NKV + g) * HS;  // (B, T, NKV, HS)
  const int64_t q_step = NH * HS;                        // between positions of one query head

  float kx[kPerLane], vx[kPerLane];
  load_lane(kx, k + kv_off, lane, HS);
  load_lane(vx, v + kv_off, lane, HS);
  float dk_acc[kPerLane] = {}, dv_acc[kPerLane] = {};
  for (int64_t h = g * G; h < (g + 1) * G; ++h) {
    const float* q0 = q + (b * T * NH + h) * HS;  // query 0 of head h
    const float* dout0 = dout + (b * T * NH + h) * HS;
    const float* Lh = lse + (b * NH + h) * T;  // (T) of this head
    const float* Dh = D + (b * NH + h) * T;
    for (int64_t t0 = s; t0 < T; t0 += kWarp) {
      const int n = static_cast<int>(T - t0 < kWarp ? T - t0 : kWarp);  // queries left, ≥ 1
      float score = 0.0f, dp = 0.0f;  // lane j: query t0 + j
      for (int j = 0; j < n; ++j) {
        // k_s·q_t: the same products and the same order as the dq kernel's q_t·k_s.
        const float sj = warp_dot(kx, q0 + (t0 + j) * q_step, lane, HS);
        const float dpj = warp_dot(vx, dout0 + (t0 + j) * q_step, lane, HS);
        if (lane == j) score = sj, dp = dpj;
      }
      float p = 0.0f, ds = 0.0f;
      if (lane < n) {
        p = expf(score * scale - Lh[t0 + lane]);
        ds = p * (dp - Dh[t0 + lane]);
      }
      for (int j = 0; j < n; ++j) {
        const float pj = __shfl_sync(kFullMask, p, j);
        const float dsj = __shfl_sync(kFullMask, ds, j);
        axpy_lane(dv_acc, pj, dout0 + (t0 + j) * q_step, lane, HS);
        axpy_lane(dk_acc, dsj, q0 + (t0 + j) * q_step, lane, HS);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + i * kWarp;
    if (d < HS) {
      dk[kv_off + d] = dk_acc[i] * scale;
      dv[kv_off + d] = dv_acc[i];
    }
  }
}

// The CPU kernel's shape rules, and the head size the register layout holds.
void check_args(const char* fn, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  attention_check_args(fn, B, T, NH, NKV, HS);
  MOETRAIN_CHECK(HS <= kMaxHS, "{}: head size HS={} must be in 1..{} on the device", fn, HS,
                 kMaxHS);
}

// Blocks of kWarps rows covering `rows`, within the grid's x limit.
unsigned row_blocks(const char* fn, int64_t rows) {
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  MOETRAIN_CHECK(blocks <= 0x7fffffff, "{}: {} rows are too many for one grid", fn, rows);
  return static_cast<unsigned>(blocks);
}

// The scale of the CPU kernel, computed the same way so that both use the same float.
float score_scale(int64_t HS) {
  return 1.0f / std::sqrt(static_cast<float>(HS));
}

// D (B, NH, T) of one backward call, stream-ordered so that it lives exactly as long as the
// kernels that use it; the destructor frees it on an early exit (a failed launch check).
class StreamScratch {
 public:
  StreamScratch(int64_t n, cudaStream_t s) : s_(s) {
    MOETRAIN_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&p_), sizeof(float) * n, s));
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  ~StreamScratch() {
    if (p_) cudaFreeAsync(p_, s_);
  }
  float* data() { return p_; }
  void release() {
    float* p = p_;
    p_ = nullptr;
    MOETRAIN_CUDA_CHECK(cudaFreeAsync(p, s_));
  }

 private:
  float* p_ = nullptr;
  cudaStream_t s_;
};

}  // namespace

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, cudaStream_t s) {
  check_args("cuda::attention_forward", B, T, NH, NKV, HS);
  if (B == 0 || T == 0) return;
  MOETRAIN_CHECK(out && lse && q && k && v, "cuda::attention_forward: null buffer for B={} T={}",
                 B, T);
  const unsigned blocks = row_blocks("cuda::attention_forward", B * NH * T);
  attention_forward_kernel<<<blocks, kThreads, 0, s>>>(out, lse, q, k, v, B, T, NH, NKV,
                                                       static_cast<int>(HS), score_scale(HS));
  MOETRAIN_CUDA_LAUNCHED();
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                        cudaStream_t s) {
  check_args("cuda::attention_backward", B, T, NH, NKV, HS);
  if (B == 0 || T == 0) return;
  MOETRAIN_CHECK(dq && dk && dv && dout && q && k && v && out && lse,
                 "cuda::attention_backward: null buffer for B={} T={}", B, T);
  const unsigned q_blocks = row_blocks("cuda::attention_backward", B * NH * T);
  const unsigned kv_blocks = row_blocks("cuda::attention_backward", B * NKV * T);
  const float scale = score_scale(HS);
  const int hs = static_cast<int>(HS);
  StreamScratch D(B * NH * T, s);
  attention_dq_kernel<<<q_blocks, kThreads, 0, s>>>(dq, D.data(), dout, q, k, v, out, lse, B, T,
                                                    NH, NKV, hs, scale);
  MOETRAIN_CUDA_LAUNCHED();
  attention_dkdv_kernel<<<kv_blocks, kThreads, 0, s>>>(dk, dv, dout, q, k, v, lse, D.data(), B,
                                                       T, NH, NKV, hs, scale);
  MOETRAIN_CUDA_LAUNCHED();
  D.release();
}

}  // namespace moetrain::cuda
