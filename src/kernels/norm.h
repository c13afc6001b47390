// RMSNorm as Hugging Face Llama/Mixtral define it: y = weight ⊙ x / sqrt(mean(x²) + eps).
#pragma once
#include <cstdint>

namespace moetrain {

// out (N, C) = weight ⊙ (inp · rstd);  rstd (N) = 1 / sqrt(mean(inp²) + eps), saved for backward.
// out may alias inp.
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps);
// The residual stream's add fused in front: sum (N, C) += add, then out = rmsnorm(sum) as above
// (the same bits as the add and the norm in two passes). out must not alias sum or add.
void add_rmsnorm_forward(float* out, float* rstd, float* sum, const float* add,
                         const float* weight, int64_t N, int64_t C, float eps);
// dinp (N, C) =  ;  dweight (C) +=  ;  dout, inp (N, C);  weight (C);  rstd (N) from the forward.
// dweight is bitwise identical for any thread count: each column sums its rows in fixed chunks of
// rows, each in row order (in double), then the chunks' sums in chunk order.
// residual (N, C), where given: dinp = the norm's input gradient + residual (a residual stream's
// two branches joined in the same pass; the same bits as adding after). dinp must not alias dout,
// inp or residual.
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C,
                      const float* residual = nullptr);

}  // namespace moetrain
