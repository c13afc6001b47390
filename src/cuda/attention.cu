// Device causal grouped-query attention (kernels.h, "attention.cu"): the forward pass (out, lse)
// and the flash-style backward pass (dq, dk, dv) of kernels/attention.h, with its layouts and its
// formulas: scores q·k / √HS, query t sees keys 0..t, head h reads kv head h / (NH / NKV).
//
// Every row is owned by one warp: query rows in the forward and dq kernels, key rows of a kv head
// in the dk/dv kernel, kRows rows to a warp and kWarps warps of one head to a block; the other
// side goes through shared memory 32 rows (a chunk) at a time (see "Shared-memory tiles" below).
// No atomics: every output element is summed by one lane in a fixed order, so runs are bitwise
// repeatable.

#include <cmath>
#include <cstdint>
#include <type_traits>

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
__device__ __forceinline__ void load_lane(float (&x)[PL], const float* __restrict__ row,
                                          int lane, int HS) {
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int d = lane + i * kWarp;
    x[i] = d < HS ? row[d] : 0.0f;
  }
}

// Σ_d x[d]·row[d] with x split over the lanes as load_lane leaves it: each lane sums its share in
// order, the butterfly adds the 32 partial sums. Every lane gets the same value.
template <int PL>
__device__ __forceinline__ float warp_dot(const float (&x)[PL],
                                          const float* __restrict__ row, int lane, int HS) {
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
constexpr int kRows = 2;                   // rows per warp
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
__device__ __forceinline__ void weighted_rows(float (&acc)[kRows][PL],
                                              const float* __restrict__ w,
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

}  // namespace

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, cudaStream_t s) {
  check_args("cuda::attention_forward", B, T, NH, NKV, HS);
  if (B == 0 || T == 0) return;
  MOETRAIN_CHECK(out && lse && q && k && v, "cuda::attention_forward: null buffer for B={} T={}",
                 B, T);
  const int hs = static_cast<int>(HS);
  const dim3 grid = row_grid("cuda::attention_forward", T, B * NH);
  with_lane_share(hs, [&](auto pl) {
    const auto kernel = attention_forward_kernel<decltype(pl)::value>;
    kernel<<<grid, kThreads, shared_bytes(kernel, hs, 1, 1), s>>>(out, lse, q, k, v, T, NH, NKV,
                                                                  hs, score_scale(HS));
  });
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
