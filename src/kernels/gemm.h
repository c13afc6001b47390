// Every matrix product in moetrain goes through oneDNN's matmul primitive, here.
// Row-major throughout. op(X) = X or X^T as Trans says; leading dimensions default to packed.
// Inputs f32, bf16 or fp16; accumulation and output always f32. 16-bit inputs run on oneDNN's
// bf16 / f16 matmul where the CPU has it, and are otherwise widened to f32 (exact products, so
// the same result without the speed-up; see gemm_is_native). `accumulate` adds into C (beta = 1),
// which is how parameter gradients are `+=`.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace moetrain {

enum class Trans { N, T };

// C (M, N) = op(A) (M, K) · op(B) (K, N)  [+ C]
// A is stored (M, K) for Trans::N or (K, M) for Trans::T; likewise B (K, N) or (N, K).
void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const float* A, const float* B,
          float* C, bool accumulate, int64_t lda = 0, int64_t ldb = 0, int64_t ldc = 0);
void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const bf16* A, const bf16* B,
          float* C, bool accumulate, int64_t lda = 0, int64_t ldb = 0, int64_t ldc = 0);
void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const fp16* A, const fp16* B,
          float* C, bool accumulate, int64_t lda = 0, int64_t ldb = 0, int64_t ldc = 0);
// The operand type chosen at run time (mixed precision): A and B both hold elements of t.
void gemm(DType t, Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const void* A,
          const void* B, float* C, bool accumulate, int64_t lda = 0, int64_t ldb = 0,
          int64_t ldc = 0);
// Whether oneDNN computes GEMMs with t operands natively on this CPU (f32 always; bf16 needs
// AVX512_BF16 or AMX, fp16 AVX512_FP16). When not, t operands are widened to f32.
bool gemm_is_native(DType t);

// A fully connected layer with weights stored (OC, IC), as PyTorch/Hugging Face store them.
// out (N, OC) = inp (N, IC) · W^T
void linear_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t IC,
                    int64_t OC);
// dinp (N, IC) = dout · W  (dinp may be null); dweight (OC, IC) += dout^T · inp
void linear_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t IC, int64_t OC);

// Grouped GEMM, as the experts need: G problems that share K and N but each have their own row
// count M_g (may be 0) and their own weights B_g = B + g * b_stride. Rows of A and C are packed
// group after group (group g starts at row sum_{h<g} M_h).
// C_g (M_g, N) = A_g (M_g, K) · op(B_g) (K, N)  [+ C_g]
void grouped_gemm(Trans tb, int64_t G, const int64_t* M, int64_t N, int64_t K, const float* A,
                  const float* B, int64_t b_stride, float* C, bool accumulate);
void grouped_gemm(Trans tb, int64_t G, const int64_t* M, int64_t N, int64_t K, const bf16* A,
                  const bf16* B, int64_t b_stride, float* C, bool accumulate);
void grouped_gemm(Trans tb, int64_t G, const int64_t* M, int64_t N, int64_t K, const fp16* A,
                  const fp16* B, int64_t b_stride, float* C, bool accumulate);

// The weight-gradient form: the per-group row count is the reduction dimension.
// C_g (P, Q) = A_g^T (P, M_g) · B_g (M_g, Q)  [+ C_g],  C_g = C + g * c_stride.
// A_g (M_g, P) and B_g (M_g, Q) are packed group after group. A group with M_g = 0 leaves C_g
// unchanged when accumulating, zero otherwise.
void grouped_gemm_reduce(int64_t G, const int64_t* M, int64_t P, int64_t Q, const float* A,
                         const float* B, float* C, int64_t c_stride, bool accumulate);
void grouped_gemm_reduce(int64_t G, const int64_t* M, int64_t P, int64_t Q, const bf16* A,
                         const bf16* B, float* C, int64_t c_stride, bool accumulate);
void grouped_gemm_reduce(int64_t G, const int64_t* M, int64_t P, int64_t Q, const fp16* A,
                         const fp16* B, float* C, int64_t c_stride, bool accumulate);

// Number of distinct oneDNN primitives built so far (tests check the hot loop builds none).
int64_t gemm_primitives_built();
// oneDNN version and the instruction set it dispatches to, e.g. "oneDNN 2.6.3, avx512_core_bf16".
const char* gemm_backend_info();

}  // namespace moetrain
