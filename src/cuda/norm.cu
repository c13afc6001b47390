// Device RMSNorm (kernels.h, "norm.cu"), Hugging Face's y = weight ⊙ x / sqrt(mean(x²) + eps),
// with the float operations of kernels/norm.cpp: row sums in double (a block reduction here, so
// only their order differs from the CPU's), everything after them in the CPU's order, uncontracted.
// dweight is summed by one thread per column, in the CPU's chunks of 256 rows (each in row order,
// then the chunks in order): bitwise the CPU's for the same rstd.

#include <cstdint>

#include "cuda/device.h"
#include "cuda/kernels.h"
#include "cuda/reduce.cuh"

namespace moetrain::cuda {

namespace {

constexpr int kRowThreads = 256;  // a block per row
// dweight: a block per kDwCols columns, loading tiles of kDwRows rows.
constexpr int kDwThreads = 256;
constexpr int kDwCols = 8;
constexpr int kDwRows = 256;  // kernels/norm.cpp's kRowChunk: the tiles are its chunks
static_assert(kRowThreads % 32 == 0 && kRowThreads <= 1024);
static_assert(kDwRows * kDwCols % kDwThreads == 0 && kDwCols <= kDwThreads);

// One block per row (grid N). out may alias inp: every read of the row happens before block_sum's
// barriers, every write after them, and each element is read and written by the same thread.
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_forward_kernel(float* out, float* rstd, const float* inp, const float* weight,
                           int64_t C, float eps) {
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  float* y = out + n * C;
  double ss = 0.0;
  for (int64_t c = threadIdx.x; c < C; c += kRowThreads) {
    const double xc = x[c];
    ss = __dadd_rn(ss, __dmul_rn(xc, xc));
  }
  ss = block_sum(ss);
  // CPU: float(1.0 / sqrt(ss / double(C) + double(eps))).
  const float r = static_cast<float>(__ddiv_rn(
      1.0, __dsqrt_rn(__dadd_rn(__ddiv_rn(ss, static_cast<double>(C)), static_cast<double>(eps)))));
  if (threadIdx.x == 0) rstd[n] = r;
  // CPU: weight[c] * (x[c] * r).
  for (int64_t c = threadIdx.x; c < C; c += kRowThreads)
    y[c] = __fmul_rn(weight[c], __fmul_rn(x[c], r));
}

// dinp, one block per row (grid N):  dx_j = r w_j dy_j − r³ x_j / C · Σ_c dy_c w_c x_c.
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_backward_dinp_kernel(float* dinp, const float* dout, const float* inp,
                                 const float* weight, const float* rstd, int64_t C) {
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  const float* dy = dout + n * C;
  float* dx = dinp + n * C;
  const double r = rstd[n];
  double dot = 0.0;
  for (int64_t c = threadIdx.x; c < C; c += kRowThreads) {
    // CPU: double(dy[c]) * weight[c] * x[c], left to right in double.
    const double term =
        __dmul_rn(__dmul_rn(static_cast<double>(dy[c]), static_cast<double>(weight[c])),
                  static_cast<double>(x[c]));
    dot = __dadd_rn(dot, term);
  }
  dot = block_sum(dot);
  // CPU: float(r * r * r * dot / double(C)).
  const float k = static_cast<float>(
      __ddiv_rn(__dmul_rn(__dmul_rn(__dmul_rn(r, r), r), dot), static_cast<double>(C)));
  const float rf = static_cast<float>(r);
  // CPU: rf * weight[c] * dy[c] - k * x[c].
  for (int64_t c = threadIdx.x; c < C; c += kRowThreads) {
    dx[c] = __fsub_rn(__fmul_rn(__fmul_rn(rf, weight[c]), dy[c]), __fmul_rn(k, x[c]));
  }
}

// dweight (C) += Σ_n dy_nc x_nc r_n, bitwise the CPU's: per column, the CPU's double terms
// (dy·x)·r added in row order within each tile of kDwRows rows (the CPU's chunks), the tiles'
// sums in order. A block owns kDwCols adjacent columns (one 32-byte sector per row)
// and walks the rows in tiles: all its threads load a tile and compute its terms into shared
// memory (many loads in flight), then one thread per column adds them in row order. Only the
// loading is parallel; every sum is serial, so the order is the CPU's.
__global__ void __launch_bounds__(kDwThreads)
    rmsnorm_backward_dweight_kernel(float* dweight, const float* dout, const float* inp,
                                    const float* rstd, int64_t N, int64_t C) {
  __shared__ double terms[kDwRows][kDwCols];  // (tile row, column)
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kDwCols;
  double acc = 0.0;  // column c0 + threadIdx.x, on threads below kDwCols
  for (int64_t n0 = 0; n0 < N; n0 += kDwRows) {
    // Element e of the tile is row e / kDwCols, column e % kDwCols: a warp reads whole sectors.
    for (int k = 0; k < kDwRows * kDwCols / kDwThreads; ++k) {
      const int e = threadIdx.x + k * kDwThreads;
      const int r = e / kDwCols, j = e % kDwCols;
      const int64_t n = n0 + r, c = c0 + j;
      double term = 0.0;
      if (n < N && c < C) {
        const int64_t i = n * C + c;
        // CPU: double(dy[c]) * x[c] * r.
        term = __dmul_rn(__dmul_rn(static_cast<double>(dout[i]), static_cast<double>(inp[i])),
                         static_cast<double>(rstd[n]));
      }
      terms[r][j] = term;
    }
    __syncthreads();
    if (threadIdx.x < kDwCols) {
      // The CPU's chunks of kRowChunk = kDwRows rows: each summed from zero in row order, then
      // added to the running sum in chunk order.
      const int64_t rows = N - n0 < kDwRows ? N - n0 : kDwRows;
      double chunk = 0.0;
      for (int64_t r = 0; r < rows; ++r) chunk = __dadd_rn(chunk, terms[r][threadIdx.x]);
      acc = __dadd_rn(acc, chunk);
    }
    // The next tile overwrites terms.
    __syncthreads();
  }
  const int64_t c = c0 + threadIdx.x;
  if (threadIdx.x < kDwCols && c < C) dweight[c] = __fadd_rn(dweight[c], static_cast<float>(acc));
}

void check_shape(const char* fn, int64_t N, int64_t C) {
  MOETRAIN_CHECK(N >= 0 && C > 0, "{}: need N >= 0 and C > 0, got N={} C={}", fn, N, C);
  MOETRAIN_CHECK(N <= 0x7fffffff, "{}: N={} rows exceed the grid", fn, N);
}

}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps, cudaStream_t s) {
  check_shape("cuda::rmsnorm_forward", N, C);
  MOETRAIN_CHECK(eps >= 0.0f, "cuda::rmsnorm_forward: eps must be >= 0, got {}", eps);
  if (N == 0) return;
  rmsnorm_forward_kernel<<<static_cast<unsigned>(N), kRowThreads, 0, s>>>(out, rstd, inp, weight, C,
                                                                          eps);
  MOETRAIN_CUDA_LAUNCHED();
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C,
                      cudaStream_t s) {
  check_shape("cuda::rmsnorm_backward", N, C);
  if (N > 0) {
    rmsnorm_backward_dinp_kernel<<<static_cast<unsigned>(N), kRowThreads, 0, s>>>(dinp, dout, inp,
                                                                                  weight, rstd, C);
    MOETRAIN_CUDA_LAUNCHED();
  }
  // Launched for N = 0 too: the CPU then still adds its zero sums (turning −0 into +0).
  rmsnorm_backward_dweight_kernel<<<blocks_for(C, kDwCols), kDwThreads, 0, s>>>(dweight, dout, inp,
                                                                                rstd, N, C);
  MOETRAIN_CUDA_LAUNCHED();
}

}  // namespace moetrain::cuda
