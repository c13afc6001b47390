// Token embedding lookup (the model's wte): one table row per token id.
#pragma once
#include <cstdint>

namespace moetrain {

// out (N, C) = table[ids];  ids (N) in [0, V);  table (V, C).
void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                       int64_t V);
// dtable (V, C) += scatter of dout (N, C) by ids (N). An id that repeats accumulates its rows in
// token order, so the result is bitwise identical for any thread count.
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C,
                        int64_t V);

}  // namespace moetrain
