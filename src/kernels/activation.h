// SiLU and SwiGLU, elementwise. silu(x) = x · sigmoid(x); swiglu(a, b) = silu(a) ⊙ b.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace moetrain {

// out (n) = silu(inp)
void silu_forward(float* out, const float* inp, int64_t n);
// dinp (n) = dout · silu'(inp)
void silu_backward(float* dinp, const float* dout, const float* inp, int64_t n);

// SwiGLU over the two halves of an expert's first projection: out = silu(a) ⊙ b.
// out, a, b (n)
void swiglu_forward(float* out, const float* a, const float* b, int64_t n);
// da = dout ⊙ b ⊙ silu'(a);  db = dout ⊙ silu(a)
void swiglu_backward(float* da, float* db, const float* dout, const float* a, const float* b,
                     int64_t n);

// The same f32 computation with its outputs rounded as bf16(float) / fp16(float) round them: the
// operands of the next GEMM in mixed precision, written without an f32 copy first.
void swiglu_forward(bf16* out, const float* a, const float* b, int64_t n);
void swiglu_forward(fp16* out, const float* a, const float* b, int64_t n);
void swiglu_backward(bf16* da, bf16* db, const float* dout, const float* a, const float* b,
                     int64_t n);
void swiglu_backward(fp16* da, fp16* db, const float* dout, const float* a, const float* b,
                     int64_t n);

}  // namespace moetrain
