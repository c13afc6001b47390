#include "cuda/gemm.h"

namespace moetrain::cuda {

void gemm(const Context& ctx, Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const float* A,
          const float* B, float* C, bool accumulate) {
  MOETRAIN_CHECK(M >= 0 && N >= 0 && K >= 0, "cuda::gemm: negative shape M={} N={} K={}", M, N, K);
  MOETRAIN_CHECK(M < (int64_t{1} << 31) && N < (int64_t{1} << 31) && K < (int64_t{1} << 31),
                 "cuda::gemm: shape M={} N={} K={} beyond cuBLAS's 32-bit sizes", M, N, K);
  if (M == 0 || N == 0) return;
  if (K == 0 && accumulate) return;
  // cuBLAS is column-major: a row-major X (r, c) is the column-major Xᵀ. C = op(A)·op(B) is then
  // computed as Cᵀ = op(B)ᵀ·op(A)ᵀ, with the operands in their stored order and the same ops.
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const cublasOperation_t opa = ta == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t opb = tb == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  const int lda = static_cast<int>(ta == Trans::N ? K : M);
  const int ldb = static_cast<int>(tb == Trans::N ? N : K);
  if (K == 0) {
    MOETRAIN_CUDA_CHECK(cudaMemsetAsync(C, 0, sizeof(float) * M * N, ctx.stream()));
    return;
  }
  MOETRAIN_CUBLAS_CHECK(cublasSgemm(ctx.blas(), opb, opa, static_cast<int>(N), static_cast<int>(M),
                                    static_cast<int>(K), &alpha, B, ldb, A, lda, &beta, C,
                                    static_cast<int>(N)));
}

}  // namespace moetrain::cuda
