// Device causal grouped-query attention (kernels.h, "attention.cu"): the forward pass (out, lse)
// and the flash-style backward pass (dq, dk, dv) of kernels/attention.h, with its layouts and its
// formulas: scores q·k / √HS, query t sees keys 0..t, head h reads kv head h / (NH / NKV).
//
// Every row is owned by one warp: query rows in the forward and dq kernels, key rows of a kv head
// in the dk/dv kernel, kRows rows to a warp and kWarps warps of one head to a block; the other
// side goes through shared memory 32 rows (a chunk) at a time (see "Shared-memory tiles" below).
// No atomics: every output element is summed by one lane in a fixed order, so runs are bitwise
// repeatable.
//
// That is the f32 path (train.precision f32: the CPU's formulas and error bounds). With TF32 or
// bf16 GEMMs the four products of the forward and backward run on the tensor cores instead, as
// batched GEMMs over (batch, head) pairs with the score matrices materialised a chunk of pairs at
// a time ("The tensor-core path" below).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/bf16.cuh"
#include "cuda/device.h"
#include "cuda/kernels.h"
#include "cuda/reduce.cuh"
#include "kernels/attention.h"

namespace moetrain::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 8;  // warps per block
constexpr int kThreads = kWarp * kWarps;
// A lane holds its share of a head-dimension row in registers: PL = HS / 32 floats (rounded up to
// 1, 2, 4 or 8) per accumulator, a template parameter of the kernels.
constexpr int kMaxHS = 256;

// This lane's share x[i] = row[lane + 32·i] of a head-dimension row.
template <int PL>
__device__ __forceinline__ void load_lane(float (&x)[PL], const float* __restrict__ row, int lane,
                                          int HS) {
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int d = lane + i * kWarp;
    x[i] = d < HS ? row[d] : 0.0f;
  }
}

// Σ_d x[d]·row[d] with x split over the lanes as load_lane leaves it: each lane sums its share in
// order, the butterfly adds the 32 partial sums. Every lane gets the same value.
template <int PL>
__device__ __forceinline__ float warp_dot(const float (&x)[PL], const float* __restrict__ row,
                                          int lane, int HS) {
  float part = 0.0f;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int d = lane + i * kWarp;
    if (d < HS) part += x[i] * row[d];
  }
  return warp_sum(part);
}

// Shared-memory tiles. A block is kWarps warps of kRows rows each, all of one (b, head):
// consecutive query rows (the forward and dq) or key rows (dk/dv). The block walks the other side
// 32 rows (one chunk) at a time: its threads copy the chunk's two operand tiles (k and v, or q and
// dout) into shared memory once for all its warps. Lane j then computes the scores of the warp's
// rows against chunk row j, each a whole dot product over the head dimension read four floats at
// a time (the warp's rows broadcast), so a chunk costs one butterfly per row for the max and sum
// instead of one per score, and each tile element read serves kRows rows. The weights go through
// shared memory (four at a time, broadcast) to the weighted sums, where the lanes split the head
// dimension (lane i holds elements i, i + 32, ...) and each tile element read again serves kRows
// rows. Rows are zero-padded to HS4 = HS rounded up to 4 (zeros add exact zeros to every sum), and
// tiles pitched so that a quarter-warp's float4 reads of eight rows hit 32 different banks.
constexpr int kRows = 2;                    // rows per warp
constexpr int kBlockRows = kWarps * kRows;  // rows per block

__host__ __device__ constexpr int hs4(int HS) {
  return (HS + 3) / 4 * 4;
}
// An odd number of float4s a tile row.
__host__ __device__ constexpr int tile_pitch(int HS) {
  return hs4(HS) / 4 % 2 == 1 ? hs4(HS) : hs4(HS) + 4;
}
// Floats of shared memory: two chunk tiles, `own` per-warp operand rows (kRows each) and `weights`
// per-warp weight vectors (32 per row).
__host__ __device__ constexpr int tile_floats(int HS, int own, int weights) {
  return 2 * kWarp * tile_pitch(HS) + own * kBlockRows * hs4(HS) + weights * kBlockRows * kWarp;
}

// Copies rows [r0, r0 + n) (stride `step` floats) of src into the tile (kWarp rows, pitch
// tile_pitch), zeros past n rows and past HS columns; all threads of the block take part.
__device__ __forceinline__ void load_tile(float* __restrict__ tile, const float* __restrict__ src,
                                          int64_t r0, int n, int64_t step, int HS) {
  const int P = tile_pitch(HS), W = hs4(HS);
  for (int i = static_cast<int>(threadIdx.x); i < kWarp * W; i += kThreads) {
    const int r = i / W, d = i - r * W;
    tile[r * P + d] = r < n && d < HS ? src[(r0 + r) * step + d] : 0.0f;
  }
}

// This warp's copy of a row (HS floats, zero-padded to hs4) in shared memory; zeros if !valid.
__device__ __forceinline__ void load_row(float* __restrict__ dst, const float* __restrict__ src,
                                         bool valid, int lane, int HS) {
  for (int d = lane; d < hs4(HS); d += kWarp) dst[d] = valid && d < HS ? src[d] : 0.0f;
}

// acc_r = Σ_d row_r[d]·tile[j][d], r < kRows, each summed in d order (the same products in the
// same order whichever side is the tile).
__device__ __forceinline__ void tile_dots(float (&acc)[kRows], const float* __restrict__ rows,
                                          const float* __restrict__ tile, int j, int HS) {
  const float4* t = reinterpret_cast<const float4*>(tile + j * tile_pitch(HS));
  const int n4 = hs4(HS) / 4;
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
#pragma unroll 4
  for (int d = 0; d < n4; ++d) {
    const float4 y = t[d];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float4 x = reinterpret_cast<const float4*>(rows + r * hs4(HS))[d];
      acc[r] += x.x * y.x;
      acc[r] += x.y * y.y;
      acc[r] += x.z * y.z;
      acc[r] += x.w * y.w;
    }
  }
}

// acc[r][i] += w_r[j] · tile[j][lane + 32·i] for j in [j0, n) (n ≤ 32, weights past n are zero),
// four weights at a time from this warp's weight vectors w (kRows × 32).
template <int PL>
__device__ __forceinline__ void weighted_rows(float (&acc)[kRows][PL], const float* __restrict__ w,
                                              const float* __restrict__ tile, int j0, int n,
                                              int lane, int HS) {
  const int P = tile_pitch(HS);
  for (int j4 = j0 / 4 * 4; j4 < n; j4 += 4) {
    float4 wr[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) wr[r] = *reinterpret_cast<const float4*>(w + r * kWarp + j4);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float* row = tile + (j4 + q) * P;
#pragma unroll
      for (int i = 0; i < PL; ++i) {
        const int d = lane + i * kWarp;
        if (d < HS) {
          const float y = row[d];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const float wq = q == 0 ? wr[r].x : q == 1 ? wr[r].y : q == 2 ? wr[r].z : wr[r].w;
            acc[r][i] += wq * y;
          }
        }
      }
    }
  }
}

// Block (x, y): query rows t_r = T−1−(x·kBlockRows + w·kRows + r) (latest first: the longest rows
// start early) of (b, h) = y. Online softmax over chunks of 32 keys: lane j holds key s0 + j's
// score and weight for each row, each row's running max m and sum l are warp-uniform, and its
// accumulator is rescaled by exp(m_old − m_new) when the max grows.
template <int PL>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(float* __restrict__ out, float* __restrict__ lse,
                             const float* __restrict__ q, const float* __restrict__ k,
                             const float* __restrict__ v, int64_t T, int64_t NH, int64_t NKV,
                             int HS, float scale) {
  extern __shared__ float4 smem4[];
  float* ks = reinterpret_cast<float*>(smem4);
  float* vs = ks + kWarp * tile_pitch(HS);
  const int w = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  float* qrows = vs + kWarp * tile_pitch(HS) + w * kRows * hs4(HS);
  float* wts = vs + kWarp * tile_pitch(HS) + kBlockRows * hs4(HS) + w * kRows * kWarp;
  const int64_t bh = blockIdx.y, h = bh % NH, b = bh / NH, g = h / (NH / NKV);
  const int64_t t_top = T - 1 - static_cast<int64_t>(blockIdx.x) * kBlockRows;
  int64_t t[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    t[r] = t_top - w * kRows - r;  // < 0: no row (the warp still helps load the tiles)
    load_row(qrows + r * hs4(HS), q + ((b * T + t[r]) * NH + h) * HS, t[r] >= 0, lane, HS);
  }
  const int64_t kv_step = NKV * HS;              // between positions of one kv head
  const float* k0 = k + (b * T * NKV + g) * HS;  // key 0 of kv head g
  const float* v0 = v + (b * T * NKV + g) * HS;

  float acc[kRows][PL] = {};  // unnormalised out, relative to exp(m)
  float m[kRows], l[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) m[r] = -INFINITY, l[r] = 0.0f;
  for (int64_t s0 = 0; s0 <= t_top; s0 += kWarp) {
    const int chunk = static_cast<int>(t_top - s0 + 1 < kWarp ? t_top - s0 + 1 : kWarp);
    __syncthreads();  // the previous chunk's tiles are no longer read
    load_tile(ks, k0, s0, chunk, kv_step, HS);
    load_tile(vs, v0, s0, chunk, kv_step, HS);
    __syncthreads();
    if (s0 > t[0]) continue;  // warp-uniform: t[0] is the warp's latest row
    float score[kRows];
    tile_dots(score, qrows, ks, lane, HS);
    int n_max = 0;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      // Keys seen by row r in this chunk: none where t[r] < s0 (then p = 0 and m, l, acc hold).
      const int n = t[r] < s0 ? 0 : static_cast<int>(t[r] - s0 + 1 < kWarp ? t[r] - s0 + 1 : kWarp);
      n_max = n > n_max ? n : n_max;
      const float sc = lane < n ? score[r] * scale : -INFINITY;
      // Lane 0's key is seen whenever n > 0, so m_new is finite for finite inputs.
      const float m_new = n > 0 ? fmaxf(m[r], warp_max(sc)) : m[r];
      const float p = lane < n ? expf(sc - m_new) : 0.0f;
      const float alpha = n > 0 ? expf(m[r] - m_new) : 1.0f;  // 0 on a row's first chunk
      l[r] = l[r] * alpha + warp_sum(p);
#pragma unroll
      for (int i = 0; i < PL; ++i) acc[r][i] *= alpha;
      m[r] = m_new;
      wts[r * kWarp + lane] = p;
    }
    __syncwarp();
    weighted_rows(acc, wts, vs, 0, n_max, lane, HS);
    __syncwarp();  // the weights are read before the next chunk writes them
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (t[r] < 0) continue;
    const int64_t q_off = ((b * T + t[r]) * NH + h) * HS;  // (B, T, NH, HS)
    const float inv_l = 1.0f / l[r];
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int d = lane + i * kWarp;
      if (d < HS) out[q_off + d] = acc[r][i] * inv_l;
    }
    if (lane == 0) lse[(b * NH + h) * T + t[r]] = m[r] + logf(l[r]);
  }
}

// Blocks as the forward's. First D_t = Σ dout_t ⊙ out_t for each row, kept in D (B, NH, T) for
// the dk/dv kernel; then dq_t = scale · Σ_{s ≤ t} ds_s · k_s with p_s = exp(score_s − lse_t) and
// ds_s = p_s · (dout_t·v_s − D_t), the CPU's formulas.
template <int PL>
__global__ void __launch_bounds__(kThreads)
    attention_dq_kernel(float* __restrict__ dq, float* __restrict__ D,
                        const float* __restrict__ dout, const float* __restrict__ q,
                        const float* __restrict__ k, const float* __restrict__ v,
                        const float* __restrict__ out, const float* __restrict__ lse, int64_t T,
                        int64_t NH, int64_t NKV, int HS, float scale) {
  extern __shared__ float4 smem4[];
  float* ks = reinterpret_cast<float*>(smem4);
  float* vs = ks + kWarp * tile_pitch(HS);
  const int w = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  float* own = vs + kWarp * tile_pitch(HS);
  float* qrows = own + w * kRows * hs4(HS);
  float* dorows = own + kBlockRows * hs4(HS) + w * kRows * hs4(HS);
  float* wts = own + 2 * kBlockRows * hs4(HS) + w * kRows * kWarp;
  const int64_t bh = blockIdx.y, h = bh % NH, b = bh / NH, g = h / (NH / NKV);
  const int64_t t_top = T - 1 - static_cast<int64_t>(blockIdx.x) * kBlockRows;
  int64_t t[kRows];
  float Dt[kRows], L[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    t[r] = t_top - w * kRows - r;
    const bool valid = t[r] >= 0;
    const int64_t q_off = ((b * T + (valid ? t[r] : 0)) * NH + h) * HS;
    load_row(qrows + r * hs4(HS), q + q_off, valid, lane, HS);
    load_row(dorows + r * hs4(HS), dout + q_off, valid, lane, HS);
    Dt[r] = 0.0f, L[r] = 0.0f;
    if (valid) {
      float dox[PL];
      load_lane(dox, dout + q_off, lane, HS);
      Dt[r] = warp_dot(dox, out + q_off, lane, HS);
      const int64_t at = (b * NH + h) * T + t[r];  // (B, NH, T)
      if (lane == 0) D[at] = Dt[r];
      L[r] = lse[at];
    }
  }
  const int64_t kv_step = NKV * HS;
  const float* k0 = k + (b * T * NKV + g) * HS;
  const float* v0 = v + (b * T * NKV + g) * HS;

  float acc[kRows][PL] = {};  // Σ ds·k, scaled at the end as the CPU does
  for (int64_t s0 = 0; s0 <= t_top; s0 += kWarp) {
    const int chunk = static_cast<int>(t_top - s0 + 1 < kWarp ? t_top - s0 + 1 : kWarp);
    __syncthreads();
    load_tile(ks, k0, s0, chunk, kv_step, HS);
    load_tile(vs, v0, s0, chunk, kv_step, HS);
    __syncthreads();
    if (s0 > t[0]) continue;
    float score[kRows], dp[kRows];
    tile_dots(score, qrows, ks, lane, HS);
    tile_dots(dp, dorows, vs, lane, HS);
    int n_max = 0;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int n = t[r] < s0 ? 0 : static_cast<int>(t[r] - s0 + 1 < kWarp ? t[r] - s0 + 1 : kWarp);
      n_max = n > n_max ? n : n_max;
      wts[r * kWarp + lane] = lane < n ? expf(score[r] * scale - L[r]) * (dp[r] - Dt[r]) : 0.0f;
    }
    __syncwarp();
    weighted_rows(acc, wts, ks, 0, n_max, lane, HS);
    __syncwarp();
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (t[r] < 0) continue;
    const int64_t q_off = ((b * T + t[r]) * NH + h) * HS;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int d = lane + i * kWarp;
      if (d < HS) dq[q_off + d] = acc[r][i] * scale;
    }
  }
}

// Block (x, y): key rows s_r = x·kBlockRows + w·kRows + r (earliest first: seen by the most
// queries) of kv head (b, g) = y. Sums over the group's query heads h in order, and within a head
// over the queries t ≥ s in order, in chunks of 32 from the block's first key (lane j computes
// query t0 + j's p and ds for each row; queries before a row's key weigh zero):
//   dv_s = Σ p_ts · dout_t,   dk_s = scale · Σ ds_ts · q_t.
// Needs D (B, NH, T) from attention_dq_kernel, which runs first on the same stream.
template <int PL>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(float* __restrict__ dk, float* __restrict__ dv,
                          const float* __restrict__ dout, const float* __restrict__ q,
                          const float* __restrict__ k, const float* __restrict__ v,
                          const float* __restrict__ lse, const float* __restrict__ D, int64_t T,
                          int64_t NH, int64_t NKV, int HS, float scale) {
  extern __shared__ float4 smem4[];
  float* qs = reinterpret_cast<float*>(smem4);
  float* dos = qs + kWarp * tile_pitch(HS);
  const int w = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  float* own = dos + kWarp * tile_pitch(HS);
  float* krows = own + w * kRows * hs4(HS);
  float* vrows = own + kBlockRows * hs4(HS) + w * kRows * hs4(HS);
  float* pw = own + 2 * kBlockRows * hs4(HS) + w * kRows * kWarp;
  float* dsw = own + 2 * kBlockRows * hs4(HS) + kBlockRows * kWarp + w * kRows * kWarp;
  const int64_t bg = blockIdx.y, g = bg % NKV, b = bg / NKV, G = NH / NKV;
  const int64_t s_first = static_cast<int64_t>(blockIdx.x) * kBlockRows;
  int64_t s[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    s[r] = s_first + w * kRows + r;  // ≥ T: no row
    const bool valid = s[r] < T;
    const int64_t kv_off = ((b * T + (valid ? s[r] : 0)) * NKV + g) * HS;  // (B, T, NKV, HS)
    load_row(krows + r * hs4(HS), k + kv_off, valid, lane, HS);
    load_row(vrows + r * hs4(HS), v + kv_off, valid, lane, HS);
  }
  const int64_t q_step = NH * HS;  // between positions of one query head

  float dk_acc[kRows][PL] = {}, dv_acc[kRows][PL] = {};
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
      if (s[0] >= T || t0 + n <= s[0]) continue;  // warp-uniform: s[0] is the warp's first key
      // k_s·q_t: the same products as the dq kernel's q_t·k_s, in the same (d) order.
      float score[kRows], dp[kRows];
      tile_dots(score, krows, qs, lane, HS);
      tile_dots(dp, vrows, dos, lane, HS);
      const int64_t tq = t0 + lane;
      const float Lq = lane < n ? Lh[tq] : 0.0f, Dq = lane < n ? Dh[tq] : 0.0f;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float p = 0.0f, ds = 0.0f;
        if (lane < n && tq >= s[r] && s[r] < T) {
          p = expf(score[r] * scale - Lq);
          ds = p * (dp[r] - Dq);
        }
        pw[r * kWarp + lane] = p;
        dsw[r * kWarp + lane] = ds;
      }
      __syncwarp();
      const int j0 = static_cast<int>(s[0] > t0 ? s[0] - t0 : 0);  // the warp's first query
      weighted_rows(dv_acc, pw, dos, j0, n, lane, HS);
      weighted_rows(dk_acc, dsw, qs, j0, n, lane, HS);
      __syncwarp();
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (s[r] >= T) continue;
    const int64_t kv_off = ((b * T + s[r]) * NKV + g) * HS;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int d = lane + i * kWarp;
      if (d < HS) {
        dk[kv_off + d] = dk_acc[r][i] * scale;
        dv[kv_off + d] = dv_acc[r][i];
      }
    }
  }
}

// The CPU kernel's shape rules, and the head size the register layout holds.
void check_args(const char* fn, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  attention_check_args(fn, B, T, NH, NKV, HS);
  MOETRAIN_CHECK(HS <= kMaxHS, "{}: head size HS={} must be in 1..{} on the device", fn, HS,
                 kMaxHS);
}

// Blocks of kBlockRows rows of T along x, one per (b, head) pair along y, within the grid's
// limits.
dim3 row_grid(const char* fn, int64_t T, int64_t pairs) {
  MOETRAIN_CHECK(pairs <= 65535, "{}: {} (batch, head) pairs are too many for one grid", fn, pairs);
  return dim3(static_cast<unsigned>((T + kBlockRows - 1) / kBlockRows),
              static_cast<unsigned>(pairs));
}

// Dynamic shared memory of a kernel (tile_floats); kernels past the default 48 KiB (large HS) are
// allowed what they need.
template <class Kernel>
std::size_t shared_bytes(Kernel kernel, int HS, int own, int weights) {
  const std::size_t bytes = sizeof(float) * tile_floats(HS, own, weights);
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

// Calls f with std::integral_constant<int, PL>, PL the smallest of 1, 2, 4, 8 with HS ≤ 32·PL: the
// floats of a head-dimension row each lane holds.
template <class F>
void with_lane_share(int HS, F&& f) {
  if (HS <= 32) {
    f(std::integral_constant<int, 1>{});
  } else if (HS <= 64) {
    f(std::integral_constant<int, 2>{});
  } else if (HS <= 128) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

// --- The tensor-core path (TF32 and bf16 GEMMs) ------------------------------------------------
// Every (batch, head) pair is one matrix product of a strided batched GEMM (cuBLAS), on heads
// packed into (B·NH, T, HSp) with HSp = HS rounded up to 8 (zero columns), in the GEMM operand
// type X: f32 for TF32 (the tensor cores round it to TF32), bf16 bits for bf16 (rounded as
// core/dtype.h rounds). A kv head is packed once per query head that reads it, so every pair's
// operands are one stride apart; dk, dv sum the group's copies back in head order.
//   forward:  S = q·kᵀ (f32)  →  P = softmax(S·scale, causal) in X, lse  →  out = P·v
//   backward: S = q·kᵀ, dP = dout·vᵀ  →  P = exp(S·scale − lse), dS = P ⊙ (dP − D) in X
//             →  dv = Pᵀ·dout, dq = scale·dS·k, dk = scale·dSᵀ·q
// with D = Σ dout·out per row, as the CPU computes it. The products span all T×T scores and the
// masked half is zeroed (the tensor cores do twice the causal work in a fraction of the time).
// Scores, dP and every sum are f32; only the GEMM operands (q, k, v, dout, P, dS) are rounded. The
// T×T buffers take at most kScoreBytes at a time: the pairs go in chunks.
constexpr int64_t kScoreBytes = int64_t{512} << 20;
constexpr int64_t kMaxBatch = 65535;  // pairs per batched GEMM call

__host__ __device__ constexpr int64_t round8(int64_t x) {
  return (x + 7) / 8 * 8;
}

__device__ __forceinline__ void put(float* p, float v) {
  *p = v;
}
__device__ __forceinline__ void put(uint16_t* p, float v) {
  *p = bf16_bits(v);
}

// dst (B·NH, T, HSp) [(b·NH + h)·T + t][x] = src (B, T, H, HS) [b][t][h / G][x] for x < HS, 0 past
// it: query heads (H = NH, G = 1) or the kv head each query head reads (H = NKV, G = NH / NKV).
template <class X>
__global__ void pack_heads_kernel(X* __restrict__ dst, const float* __restrict__ src, int64_t n,
                                  int T, int NH, int H, int G, int HS, int HSp) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int x = static_cast<int>(i % HSp);
  const int64_t row = i / HSp;  // (b·NH + h)·T + t
  const int t = static_cast<int>(row % T);
  const int64_t bh = row / T, b = bh / NH;
  const int h = static_cast<int>(bh % NH);
  put(dst + i, x < HS ? src[((b * T + t) * H + h / G) * HS + x] : 0.0f);
}

// dst (B, T, H, HS) [b][t][hh][x] = scale · Σ_{j < G} src (B·NH, T, HSp) [(b·NH + hh·G + j)·T +
// t][x], summed in j order: out and dq (H = NH, G = 1), dk and dv (H = NKV, the group's query
// heads).
__global__ void unpack_heads_kernel(float* __restrict__ dst, const float* __restrict__ src,
                                    int64_t n, int T, int NH, int H, int G, int HS, int HSp,
                                    float scale) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int x = static_cast<int>(i % HS);
  const int hh = static_cast<int>(i / HS % H);
  const int64_t bt = i / HS / H, b = bt / T;
  const int t = static_cast<int>(bt % T);
  float sum = 0.0f;
  for (int j = 0; j < G; ++j) sum += src[((b * NH + hh * G + j) * T + t) * HSp + x];
  dst[i] = sum * scale;
}

// One warp per query row r = (pair, i) of a chunk: P[r][j] = exp(S[r][j]·scale − m) / l for
// j ≤ i, 0 for i < j < T; lse[r] = m + log l (m the row's max, l = Σ exp(·− m)).
template <class X>
__global__ void __launch_bounds__(kThreads)
    softmax_rows_kernel(X* __restrict__ P, float* __restrict__ lse, const float* __restrict__ S,
                        int64_t rows, int T, int ld, float scale) {
  const int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / kWarp;
  if (r >= rows) return;
  const int lane = static_cast<int>(threadIdx.x % kWarp), i = static_cast<int>(r % T);
  const float* s = S + r * ld;
  X* p = P + r * ld;
  float m = -INFINITY;
  for (int j = lane; j <= i; j += kWarp) m = fmaxf(m, s[j] * scale);
  m = warp_max(m);
  float l = 0.0f;
  for (int j = lane; j <= i; j += kWarp) l += expf(s[j] * scale - m);
  l = warp_sum(l);
  const float inv = 1.0f / l;
  for (int j = lane; j < T; j += kWarp) put(p + j, j <= i ? expf(s[j] * scale - m) * inv : 0.0f);
  if (lane == 0) lse[r] = m + logf(l);
}

// Element (r, j) of a chunk, r = (pair, i): P = exp(S·scale − lse_r) and dS = P·(dP − D_r) for
// j ≤ i, both 0 for i < j < T.
template <class X>
__global__ void softmax_grad_kernel(X* __restrict__ P, X* __restrict__ dS,
                                    const float* __restrict__ S, const float* __restrict__ dP,
                                    const float* __restrict__ lse, const float* __restrict__ D,
                                    int64_t n, int T, int ld, float scale) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= n) return;
  const int j = static_cast<int>(e % T);
  const int64_t r = e / T;
  const int i = static_cast<int>(r % T);
  const int64_t at = r * ld + j;
  float p = 0.0f, ds = 0.0f;
  if (j <= i) {
    p = expf(S[at] * scale - lse[r]);
    ds = p * (dP[at] - D[r]);
  }
  put(P + at, p);
  put(dS + at, ds);
}

// D (B, NH, T) [(b·NH + h)·T + t] = Σ_x dout·out over the head's HS elements, in x order.
__global__ void row_dot_kernel(float* __restrict__ D, const float* __restrict__ dout,
                               const float* __restrict__ out, int64_t n, int T, int NH, int HS) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int t = static_cast<int>(i % T);
  const int64_t bh = i / T, b = bh / NH;
  const int h = static_cast<int>(bh % NH);
  const float* x = dout + ((b * T + t) * NH + h) * HS;
  const float* y = out + ((b * T + t) * NH + h) * HS;
  float sum = 0.0f;
  for (int d = 0; d < HS; ++d) sum += x[d] * y[d];
  D[i] = sum;
}

// Column-major C (m, n) = op(A)·op(B) for `batch` pairs `sa`, `sb`, `sc` elements apart: operands
// X (f32 through TF32, or bf16), C f32, f32 accumulation.
template <class X>
void batched_gemm(const Context& ctx, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const X* A,
                  int64_t lda, int64_t sa, const X* B, int64_t ldb, int64_t sb, float* C,
                  int64_t ldc, int64_t sc, int64_t batch) {
  constexpr bool bf16 = std::is_same_v<X, uint16_t>;
  const cudaDataType_t type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t compute = bf16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32;
  const float alpha = 1.0f, beta = 0.0f;
  MOETRAIN_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      ctx.blas(), ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, A, type,
      static_cast<int>(lda), sa, B, type, static_cast<int>(ldb), sb, &beta, C, CUDA_R_32F,
      static_cast<int>(ldc), sc, static_cast<int>(batch), compute, CUBLAS_GEMM_DEFAULT));
}

// Consecutive pieces of the context's workspace, each aligned to 256 bytes.
class Carve {
 public:
  explicit Carve(const Context& ctx, int64_t bytes)
      : base_(static_cast<char*>(ctx.workspace(bytes))) {}
  template <class T>
  static int64_t bytes(int64_t n) {
    return (static_cast<int64_t>(sizeof(T)) * n + 255) / 256 * 256;
  }
  template <class T>
  T* take(int64_t n) {
    T* p = reinterpret_cast<T*>(base_ + used_);
    used_ += bytes<T>(n);
    return p;
  }

 private:
  char* base_;
  int64_t used_ = 0;
};

// The shapes of one call on the tensor-core path.
struct TcShape {
  int64_t B, T, NH, NKV, HS, HSp, ld, BH;
  int64_t heads() const { return BH * T * HSp; }  // elements of one packed (B·NH, T, HSp) array
  // Pairs per chunk: the T×T buffers, `per_score` bytes a score, within kScoreBytes.
  int64_t chunk(int64_t per_score) const {
    return std::max<int64_t>(1, std::min({BH, kScoreBytes / (T * ld * per_score), kMaxBatch}));
  }
};

TcShape tc_shape(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  return {B, T, NH, NKV, HS, round8(HS), round8(T), B * NH};
}

template <class X>
void pack_heads(X* dst, const float* src, const TcShape& z, int64_t H, cudaStream_t s) {
  const int64_t n = z.heads();
  pack_heads_kernel<X><<<blocks_for(n, kThreads), kThreads, 0, s>>>(
      dst, src, n, static_cast<int>(z.T), static_cast<int>(z.NH), static_cast<int>(H),
      static_cast<int>(z.NH / H), static_cast<int>(z.HS), static_cast<int>(z.HSp));
  MOETRAIN_CUDA_LAUNCHED();
}

void unpack_heads(float* dst, const float* src, const TcShape& z, int64_t H, float scale,
                  cudaStream_t s) {
  const int64_t n = z.B * z.T * H * z.HS;
  unpack_heads_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(
      dst, src, n, static_cast<int>(z.T), static_cast<int>(z.NH), static_cast<int>(H),
      static_cast<int>(z.NH / H), static_cast<int>(z.HS), static_cast<int>(z.HSp), scale);
  MOETRAIN_CUDA_LAUNCHED();
}

// Row-major S (T, ld) [i][j] = Σ_x a[i][x]·b[j][x] of each pair, for pairs [p0, p0 + n) of the
// packed a, b: column-major Sᵀ = b·aᵀ.
template <class X>
void pair_scores(const Context& ctx, float* S, const X* a, const X* b, const TcShape& z, int64_t p0,
                 int64_t n) {
  const int64_t st = z.T * z.HSp;
  batched_gemm<X>(ctx, true, false, z.T, z.T, z.HSp, b + p0 * st, z.HSp, st, a + p0 * st, z.HSp, st,
                  S, z.ld, z.T * z.ld, n);
}

// Row-major out (T, HSp) = W·y (W row-major (T, ld), trans: Wᵀ·y) of each pair, pairs
// [p0, p0 + n): column-major outᵀ = yᵀ·Wᵀ (or yᵀ·W).
template <class X>
void pair_weighted(const Context& ctx, float* out, const X* W, const X* y, bool trans,
                   const TcShape& z, int64_t p0, int64_t n) {
  const int64_t st = z.T * z.HSp;
  batched_gemm<X>(ctx, false, trans, z.HSp, z.T, z.T, y + p0 * st, z.HSp, st, W, z.ld, z.T * z.ld,
                  out + p0 * st, z.HSp, st, n);
}

template <class X>
void tc_forward(const Context& ctx, float* out, float* lse, const float* q, const float* k,
                const float* v, const TcShape& z, float scale) {
  const cudaStream_t s = ctx.stream();
  const int64_t nc = z.chunk(sizeof(float) + sizeof(X));
  Carve w(ctx, 3 * Carve::bytes<X>(z.heads()) + Carve::bytes<float>(z.heads()) +
                   Carve::bytes<float>(nc * z.T * z.ld) + Carve::bytes<X>(nc * z.T * z.ld));
  X* qp = w.take<X>(z.heads());
  X* kp = w.take<X>(z.heads());
  X* vp = w.take<X>(z.heads());
  float* op = w.take<float>(z.heads());
  float* S = w.take<float>(nc * z.T * z.ld);
  X* P = w.take<X>(nc * z.T * z.ld);
  pack_heads(qp, q, z, z.NH, s);
  pack_heads(kp, k, z, z.NKV, s);
  pack_heads(vp, v, z, z.NKV, s);
  for (int64_t p0 = 0; p0 < z.BH; p0 += nc) {
    const int64_t n = std::min(nc, z.BH - p0), rows = n * z.T;
    pair_scores(ctx, S, qp, kp, z, p0, n);
    softmax_rows_kernel<X><<<blocks_for(rows * kWarp, kThreads), kThreads, 0, s>>>(
        P, lse + p0 * z.T, S, rows, static_cast<int>(z.T), static_cast<int>(z.ld), scale);
    MOETRAIN_CUDA_LAUNCHED();
    pair_weighted(ctx, op, P, vp, false, z, p0, n);
  }
  unpack_heads(out, op, z, z.NH, 1.0f, s);
}

template <class X>
void tc_backward(const Context& ctx, float* dq, float* dk, float* dv, const float* dout,
                 const float* q, const float* k, const float* v, const float* out, const float* lse,
                 const TcShape& z, float scale) {
  const cudaStream_t s = ctx.stream();
  const int64_t nc = z.chunk(2 * (sizeof(float) + sizeof(X)));
  const int64_t scores = nc * z.T * z.ld;
  Carve w(ctx, Carve::bytes<float>(z.BH * z.T) + 4 * Carve::bytes<X>(z.heads()) +
                   3 * Carve::bytes<float>(z.heads()) + 2 * Carve::bytes<float>(scores) +
                   2 * Carve::bytes<X>(scores));
  float* D = w.take<float>(z.BH * z.T);
  X* qp = w.take<X>(z.heads());
  X* kp = w.take<X>(z.heads());
  X* vp = w.take<X>(z.heads());
  X* dop = w.take<X>(z.heads());
  float* dqp = w.take<float>(z.heads());
  float* dkp = w.take<float>(z.heads());
  float* dvp = w.take<float>(z.heads());
  float* S = w.take<float>(scores);
  float* dP = w.take<float>(scores);
  X* P = w.take<X>(scores);
  X* dS = w.take<X>(scores);
  const int64_t nD = z.BH * z.T;
  row_dot_kernel<<<blocks_for(nD, kThreads), kThreads, 0, s>>>(
      D, dout, out, nD, static_cast<int>(z.T), static_cast<int>(z.NH), static_cast<int>(z.HS));
  MOETRAIN_CUDA_LAUNCHED();
  pack_heads(qp, q, z, z.NH, s);
  pack_heads(kp, k, z, z.NKV, s);
  pack_heads(vp, v, z, z.NKV, s);
  pack_heads(dop, dout, z, z.NH, s);
  for (int64_t p0 = 0; p0 < z.BH; p0 += nc) {
    const int64_t n = std::min(nc, z.BH - p0), elems = n * z.T * z.T;
    pair_scores(ctx, S, qp, kp, z, p0, n);
    pair_scores(ctx, dP, dop, vp, z, p0, n);
    softmax_grad_kernel<X><<<blocks_for(elems, kThreads), kThreads, 0, s>>>(
        P, dS, S, dP, lse + p0 * z.T, D + p0 * z.T, elems, static_cast<int>(z.T),
        static_cast<int>(z.ld), scale);
    MOETRAIN_CUDA_LAUNCHED();
    pair_weighted(ctx, dvp, P, dop, true, z, p0, n);
    pair_weighted(ctx, dqp, dS, kp, false, z, p0, n);
    pair_weighted(ctx, dkp, dS, qp, true, z, p0, n);
  }
  unpack_heads(dq, dqp, z, z.NH, scale, s);
  unpack_heads(dk, dkp, z, z.NKV, scale, s);
  unpack_heads(dv, dvp, z, z.NKV, 1.0f, s);
}

}  // namespace

void attention_forward(const Context& ctx, float* out, float* lse, const float* q, const float* k,
                       const float* v, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  check_args("cuda::attention_forward", B, T, NH, NKV, HS);
  if (B == 0 || T == 0) return;
  MOETRAIN_CHECK(out && lse && q && k && v, "cuda::attention_forward: null buffer for B={} T={}", B,
                 T);
  const cudaStream_t s = ctx.stream();
  switch (ctx.attention_f32() ? DeviceGemm::F32 : ctx.gemm_mode()) {
    case DeviceGemm::TF32:
      return tc_forward<float>(ctx, out, lse, q, k, v, tc_shape(B, T, NH, NKV, HS),
                               score_scale(HS));
    case DeviceGemm::BF16:
      return tc_forward<uint16_t>(ctx, out, lse, q, k, v, tc_shape(B, T, NH, NKV, HS),
                                  score_scale(HS));
    case DeviceGemm::F32:
      break;
  }
  const int hs = static_cast<int>(HS);
  const dim3 grid = row_grid("cuda::attention_forward", T, B * NH);
  with_lane_share(hs, [&](auto pl) {
    const auto kernel = attention_forward_kernel<decltype(pl)::value>;
    kernel<<<grid, kThreads, shared_bytes(kernel, hs, 1, 1), s>>>(out, lse, q, k, v, T, NH, NKV, hs,
                                                                  score_scale(HS));
  });
  MOETRAIN_CUDA_LAUNCHED();
}

void attention_backward(const Context& ctx, float* dq, float* dk, float* dv, const float* dout,
                        const float* q, const float* k, const float* v, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                        int64_t HS) {
  check_args("cuda::attention_backward", B, T, NH, NKV, HS);
  if (B == 0 || T == 0) return;
  MOETRAIN_CHECK(dq && dk && dv && dout && q && k && v && out && lse,
                 "cuda::attention_backward: null buffer for B={} T={}", B, T);
  const cudaStream_t s = ctx.stream();
  const float scale = score_scale(HS);
  switch (ctx.attention_f32() ? DeviceGemm::F32 : ctx.gemm_mode()) {
    case DeviceGemm::TF32:
      return tc_backward<float>(ctx, dq, dk, dv, dout, q, k, v, out, lse,
                                tc_shape(B, T, NH, NKV, HS), scale);
    case DeviceGemm::BF16:
      return tc_backward<uint16_t>(ctx, dq, dk, dv, dout, q, k, v, out, lse,
                                   tc_shape(B, T, NH, NKV, HS), scale);
    case DeviceGemm::F32:
      break;
  }
  const dim3 q_grid = row_grid("cuda::attention_backward", T, B * NH);
  const dim3 kv_grid = row_grid("cuda::attention_backward", T, B * NKV);
  const int hs = static_cast<int>(HS);
  StreamScratch D(B * NH * T, s);
  with_lane_share(hs, [&](auto pl) {
    const auto dq_kernel = attention_dq_kernel<decltype(pl)::value>;
    dq_kernel<<<q_grid, kThreads, shared_bytes(dq_kernel, hs, 2, 1), s>>>(
        dq, D.data(), dout, q, k, v, out, lse, T, NH, NKV, hs, scale);
    MOETRAIN_CUDA_LAUNCHED();
    const auto dkdv_kernel = attention_dkdv_kernel<decltype(pl)::value>;
    dkdv_kernel<<<kv_grid, kThreads, shared_bytes(dkdv_kernel, hs, 2, 2), s>>>(
        dk, dv, dout, q, k, v, lse, D.data(), T, NH, NKV, hs, scale);
    MOETRAIN_CUDA_LAUNCHED();
  });
  D.release();
}

}  // namespace moetrain::cuda
