// Device causal grouped-query attention (kernels.h, "attention.cu"): the forward pass (out, lse)
// and the flash-style backward pass (dq, dk, dv) of kernels/attention.h, with its layouts and its
// formulas: scores q·k / √HS, query t sees keys 0..t, head h reads kv head h / (NH / NKV).
//
// Every row is owned by one warp: a query row in the forward and dq kernels, a key row of a kv
// head in the dk/dv kernel, kWarps rows of one head to a block. The other side goes 32 rows (a
// chunk) at a time through shared-memory tiles the block loads once for its warps; lane j computes
// the chunk's row j score (and dp) as a whole dot product and then that position's softmax weight;
// the weighted sums over the 32 rows follow, the lanes splitting the head dimension (lane i holds
// elements i, i + 32, ...), each lane adding the rows in position order into its share.
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
constexpr int kWarps = 8;  // rows per block
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

// Shared-memory tiles. A block is kWarps rows of one (b, head): kWarps consecutive query rows (the
// forward and dq) or key rows (dk/dv). The block walks the other side 32 rows (one chunk) at a
// time: its threads copy the chunk's two operand tiles (k and v, or q and dout) into shared
// memory once for all its warps, and each lane then computes the score of ITS row of the chunk
// as a whole dot product over the head dimension (the warp's own row broadcast from shared
// memory), so a chunk costs one butterfly (the max, or none) instead of one per score. Tiles
// are padded to HS + 1 floats a row: lane j reading element d of row j hits bank (j + d) mod 32.
__host__ __device__ constexpr int tile_pitch(int HS) {
  return HS + 1;
}
// Floats of shared memory: two chunk tiles and kWarps rows of each of `own` per-warp operands.
__host__ __device__ constexpr int tile_floats(int HS, int own) {
  return 2 * kWarp * tile_pitch(HS) + own * kWarps * HS;
}

// Copies rows [r0, r0 + n) (stride `step` floats) of src into the tile (kWarp rows, pitch P),
// zero rows past n; all threads of the block take part.
__device__ __forceinline__ void load_tile(float* __restrict__ tile, const float* __restrict__ src,
                                          int64_t r0, int n, int64_t step, int HS) {
  const int P = tile_pitch(HS);
  for (int i = static_cast<int>(threadIdx.x); i < kWarp * HS; i += kThreads) {
    const int r = i / HS, d = i % HS;
    tile[r * P + d] = r < n ? src[(r0 + r) * step + d] : 0.0f;
  }
}

// Σ_d row[d]·tile[j][d] in d order: lane j's dot product with its own tile row.
__device__ __forceinline__ float tile_dot(const float* __restrict__ row,
                                          const float* __restrict__ tile, int j, int HS) {
  const float* t = tile + j * tile_pitch(HS);
  float acc = 0.0f;
#pragma unroll 8
  for (int d = 0; d < HS; ++d) acc += row[d] * t[d];
  return acc;
}

// acc[i] += w · tile[j][lane + 32·i] over this lane's share of the head dimension.
__device__ __forceinline__ void axpy_tile(float (&acc)[kPerLane], float w,
                                          const float* __restrict__ tile, int j, int lane,
                                          int HS) {
  const float* t = tile + j * tile_pitch(HS);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + i * kWarp;
    if (d < HS) acc[i] += w * t[d];
  }
}

// Block (x, y): query rows T−1−(x·kWarps + w) (latest first: the longest rows start early) of
// (b, h) = y. Online softmax over chunks of 32 keys: lane j holds key s0 + j's score and weight,
// the running max m and sum l are warp-uniform, and out's accumulator is rescaled by
// exp(m_old − m_new) when the max grows.
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(float* __restrict__ out, float* __restrict__ lse,
                             const float* __restrict__ q, const float* __restrict__ k,
                             const float* __restrict__ v, int64_t T, int64_t NH, int64_t NKV,
                             int HS, float scale) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = ks + kWarp * tile_pitch(HS);
  const int w = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  float* qrow = vs + kWarp * tile_pitch(HS) + w * HS;
  const int64_t bh = blockIdx.y, h = bh % NH, b = bh / NH, g = h / (NH / NKV);
  const int64_t t_top = T - 1 - static_cast<int64_t>(blockIdx.x) * kWarps;  // the block's latest
  const int64_t t = t_top - w;
  const bool active = t >= 0;  // warp-uniform; idle warps still help load the tiles
  const int64_t q_off = ((b * T + (active ? t : 0)) * NH + h) * HS;  // (B, T, NH, HS)
  const int64_t kv_step = NKV * HS;                                  // between positions
  const float* k0 = k + (b * T * NKV + g) * HS;                      // key 0 of kv head g
  const float* v0 = v + (b * T * NKV + g) * HS;
  for (int d = lane; d < HS; d += kWarp) qrow[d] = active ? q[q_off + d] : 0.0f;

  float acc[kPerLane] = {};  // unnormalised out, relative to exp(m)
  float m = -INFINITY, l = 0.0f;
  for (int64_t s0 = 0; s0 <= t_top; s0 += kWarp) {
    const int chunk = static_cast<int>(t_top - s0 + 1 < kWarp ? t_top - s0 + 1 : kWarp);
    __syncthreads();  // the previous chunk's tiles are no longer read
    load_tile(ks, k0, s0, chunk, kv_step, HS);
    load_tile(vs, v0, s0, chunk, kv_step, HS);
    __syncthreads();
    if (!active || s0 > t) continue;
    const int n = static_cast<int>(t - s0 + 1 < kWarp ? t - s0 + 1 : kWarp);  // keys seen, ≥ 1
    const float score = lane < n ? tile_dot(qrow, ks, lane, HS) * scale : -INFINITY;
    // Lane 0's key is always seen, so m_new is finite for finite inputs.
    const float m_new = fmaxf(m, warp_max(score));
    const float p = lane < n ? expf(score - m_new) : 0.0f;
    const float alpha = expf(m - m_new);  // 0 on the first chunk (m = −inf), 1 if m held
    l = l * alpha + warp_sum(p);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] *= alpha;
    for (int j = 0; j < n; ++j) axpy_tile(acc, __shfl_sync(kFullMask, p, j), vs, j, lane, HS);
    m = m_new;
  }
  if (!active) return;
  const float inv_l = 1.0f / l;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + i * kWarp;
    if (d < HS) out[q_off + d] = acc[i] * inv_l;
  }
  if (lane == 0) lse[(b * NH + h) * T + t] = m + logf(l);
}

// Blocks as the forward's. First D_t = Σ dout_t ⊙ out_t for the warp's row, kept in D
// (B, NH, T) for the dk/dv kernel; then dq_t = scale · Σ_{s ≤ t} ds_s · k_s with
// p_s = exp(score_s − lse_t) and ds_s = p_s · (dout_t·v_s − D_t), the CPU's formulas.
__global__ void __launch_bounds__(kThreads)
    attention_dq_kernel(float* __restrict__ dq, float* __restrict__ D,
                        const float* __restrict__ dout, const float* __restrict__ q,
                        const float* __restrict__ k, const float* __restrict__ v,
                        const float* __restrict__ out, const float* __restrict__ lse, int64_t T,
                        int64_t NH, int64_t NKV, int HS, float scale) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = ks + kWarp * tile_pitch(HS);
  const int w = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  float* qrow = vs + kWarp * tile_pitch(HS) + w * HS;
  float* dorow = qrow + kWarps * HS;
  const int64_t bh = blockIdx.y, h = bh % NH, b = bh / NH, g = h / (NH / NKV);
  const int64_t t_top = T - 1 - static_cast<int64_t>(blockIdx.x) * kWarps;
  const int64_t t = t_top - w;
  const bool active = t >= 0;
  const int64_t q_off = ((b * T + (active ? t : 0)) * NH + h) * HS;
  const int64_t kv_step = NKV * HS;
  const float* k0 = k + (b * T * NKV + g) * HS;
  const float* v0 = v + (b * T * NKV + g) * HS;
  const int64_t lse_at = (b * NH + h) * T + (active ? t : 0);  // (B, NH, T)
  for (int d = lane; d < HS; d += kWarp) {
    qrow[d] = active ? q[q_off + d] : 0.0f;
    dorow[d] = active ? dout[q_off + d] : 0.0f;
  }
  float Dt = 0.0f, L = 0.0f;
  if (active) {
    float dox[kPerLane];
    load_lane(dox, dout + q_off, lane, HS);
    Dt = warp_dot(dox, out + q_off, lane, HS);
    if (lane == 0) D[lse_at] = Dt;
    L = lse[lse_at];
  }
  __syncwarp();

  float acc[kPerLane] = {};  // Σ ds·k, scaled at the end as the CPU does
  for (int64_t s0 = 0; s0 <= t_top; s0 += kWarp) {
    const int chunk = static_cast<int>(t_top - s0 + 1 < kWarp ? t_top - s0 + 1 : kWarp);
    __syncthreads();
    load_tile(ks, k0, s0, chunk, kv_step, HS);
    load_tile(vs, v0, s0, chunk, kv_step, HS);
    __syncthreads();
    if (!active || s0 > t) continue;
    const int n = static_cast<int>(t - s0 + 1 < kWarp ? t - s0 + 1 : kWarp);  // keys seen
    float ds = 0.0f;  // lane j: key s0 + j
    if (lane < n) {
      const float score = tile_dot(qrow, ks, lane, HS);
      const float dp = tile_dot(dorow, vs, lane, HS);
      ds = expf(score * scale - L) * (dp - Dt);
    }
    for (int j = 0; j < n; ++j) axpy_tile(acc, __shfl_sync(kFullMask, ds, j), ks, j, lane, HS);
  }
  if (!active) return;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + i * kWarp;
    if (d < HS) dq[q_off + d] = acc[i] * scale;
  }
}

// Block (x, y): key rows s = x·kWarps + w (earliest first: seen by the most queries) of kv head
// (b, g) = y. Sums over the group's query heads h in order, and within a head over the queries
// t ≥ s in order, in chunks of 32 from the block's first key (lane j computes query t0 + j's p
// and ds; queries before the warp's key are skipped):
//   dv_s = Σ p_ts · dout_t,   dk_s = scale · Σ ds_ts · q_t.
// Needs D (B, NH, T) from attention_dq_kernel, which runs first on the same stream.
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(float* __restrict__ dk, float* __restrict__ dv,
                          const float* __restrict__ dout, const float* __restrict__ q,
                          const float* __restrict__ k, const float* __restrict__ v,
                          const float* __restrict__ lse, const float* __restrict__ D, int64_t T,
                          int64_t NH, int64_t NKV, int HS, float scale) {
  extern __shared__ float smem[];
  float* qs = smem;
  float* dos = qs + kWarp * tile_pitch(HS);
  const int w = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  float* krow = dos + kWarp * tile_pitch(HS) + w * HS;
  float* vrow = krow + kWarps * HS;
  const int64_t bg = blockIdx.y, g = bg % NKV, b = bg / NKV, G = NH / NKV;
  const int64_t s_first = static_cast<int64_t>(blockIdx.x) * kWarps;
  const int64_t s = s_first + w;
  const bool active = s < T;
  const int64_t kv_off = ((b * T + (active ? s : 0)) * NKV + g) * HS;  // (B, T, NKV, HS)
  const int64_t q_step = NH * HS;  // between positions of one query head
  for (int d = lane; d < HS; d += kWarp) {
    krow[d] = active ? k[kv_off + d] : 0.0f;
    vrow[d] = active ? v[kv_off + d] : 0.0f;
  }
  __syncwarp();

  float dk_acc[kPerLane] = {}, dv_acc[kPerLane] = {};
  for (int64_t h = g * G; h < (g + 1) * G; ++h) {
    const float* q0 = q + (b * T * NH + h) * HS;  // query 0 of head h
    const float* dout0 = dout + (b * T * NH + h) * HS;
    const float* Lh = lse + (b * NH + h) * T;  // (T) of this head
    const float* Dh = D + (b * NH + h) * T;
    for (int64_t t0 = s_first; t0 < T; t0 += kWarp) {
      const int n = static_cast<int>(T - t0 < kWarp ? T - t0 : kWarp);  // queries in the chunk
      __syncthreads();
      load_tile(qs, q0, t0, n, q_step, HS);
      load_tile(dos, dout0, t0, n, q_step, HS);
      __syncthreads();
      if (!active || t0 + n <= s) continue;
      const int j0 = static_cast<int>(s > t0 ? s - t0 : 0);  // the first query t ≥ s
      float p = 0.0f, ds = 0.0f;  // lane j: query t0 + j
      if (lane >= j0 && lane < n) {
        // k_s·q_t: the same products as the dq kernel's q_t·k_s, in the same (d) order.
        const float score = tile_dot(krow, qs, lane, HS);
        const float dp = tile_dot(vrow, dos, lane, HS);
        p = expf(score * scale - Lh[t0 + lane]);
        ds = p * (dp - Dh[t0 + lane]);
      }
      for (int j = j0; j < n; ++j) {
        axpy_tile(dv_acc, __shfl_sync(kFullMask, p, j), dos, j, lane, HS);
        axpy_tile(dk_acc, __shfl_sync(kFullMask, ds, j), qs, j, lane, HS);
      }
    }
  }
  if (!active) return;
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

// Blocks of kWarps rows of T along x, one per (b, head) pair along y, within the grid's limits.
dim3 row_grid(const char* fn, int64_t T, int64_t pairs) {
  MOETRAIN_CHECK(pairs <= 65535, "{}: {} (batch, head) pairs are too many for one grid", fn, pairs);
  return dim3(static_cast<unsigned>((T + kWarps - 1) / kWarps), static_cast<unsigned>(pairs));
}

// Dynamic shared memory of a kernel with `own` per-warp rows; kernels past the default 48 KiB
// (HS > 80 or so) are allowed what they need.
template <class Kernel>
std::size_t shared_bytes(Kernel kernel, int HS, int own) {
  const std::size_t bytes = sizeof(float) * tile_floats(HS, own);
  if (bytes > 48 * 1024)
    MOETRAIN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(bytes)));
  return bytes;
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
  const int hs = static_cast<int>(HS);
  const dim3 grid = row_grid("cuda::attention_forward", T, B * NH);
  attention_forward_kernel<<<grid, kThreads, shared_bytes(attention_forward_kernel, hs, 1), s>>>(
      out, lse, q, k, v, T, NH, NKV, hs, score_scale(HS));
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
  const dim3 q_grid = row_grid("cuda::attention_backward", T, B * NH);
  const dim3 kv_grid = row_grid("cuda::attention_backward", T, B * NKV);
  const float scale = score_scale(HS);
  const int hs = static_cast<int>(HS);
  StreamScratch D(B * NH * T, s);
  attention_dq_kernel<<<q_grid, kThreads, shared_bytes(attention_dq_kernel, hs, 2), s>>>(
      dq, D.data(), dout, q, k, v, out, lse, T, NH, NKV, hs, scale);
  MOETRAIN_CUDA_LAUNCHED();
  attention_dkdv_kernel<<<kv_grid, kThreads, shared_bytes(attention_dkdv_kernel, hs, 2), s>>>(
      dk, dv, dout, q, k, v, lse, D.data(), T, NH, NKV, hs, scale);
  MOETRAIN_CUDA_LAUNCHED();
  D.release();
}

}  // namespace moetrain::cuda
