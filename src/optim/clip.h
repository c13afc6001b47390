// Gradient clipping by global L2 norm, and the non-finite check the trainer stops on.
//
// Sums of squares are taken in double with a fixed blocking: one partial per kSumBlock elements
// (within a block, 8 interleaved accumulators combined in a fixed tree), partials added in block
// order. The result depends only on the values and their position from the start of the range,
// never on the thread count. For distributed clipping, each rank calls grad_sum_squares on its
// part, the caller sums the partial results across ranks in a fixed order, takes the sqrt, and
// each rank applies clip_coefficient / scale_gradients to its part.
#pragma once
#include <cstdint>

namespace moetrain {

inline constexpr int64_t kSumBlock = 4096;

// Σ g[i]² in double. g (n)
double grad_sum_squares(const float* g, int64_t n);

// √(grad_sum_squares(g, n)). g (n)
double grad_norm(const float* g, int64_t n);

// The factor to multiply gradients by: max_norm / (norm + 1e-6) when norm > max_norm, else 1.
// A non-finite norm gives 1: the gradients are left as they are for the caller to reject.
double clip_coefficient(double norm, double max_norm);

// g (n) *= scale
void scale_gradients(float* g, int64_t n, float scale);

// Clips g (n) in place to global norm max_norm (> 0); returns the norm before clipping.
double clip_grad_norm(float* g, int64_t n, double max_norm);

// Whether any of g (n) is NaN or ±Inf.
bool has_non_finite(const float* g, int64_t n);

}  // namespace moetrain
