// Dispatch: capacity dropping, the layout that groups assignments by expert, and the two data
// movements built on it. permute copies token rows into one buffer grouped by expert; combine
// gathers expert outputs back per token, weighted. The backward of permute is an (unweighted)
// combine and the backward of combine is a (weighted) permute, both over the same layout.
#pragma once
#include <cstdint>
#include <vector>

#include "moe/router.h"

namespace moetrain {

// Token-choice capacity: an expert keeps at most `capacity` of its assignments, those with the
// largest router weight, ties to the lower token index. Sets Routing::expert of the others to -1
// and returns how many were dropped. Routing::weight is left as it is (no renormalisation).
int64_t apply_capacity(Routing& r, int64_t capacity);

// Where every assignment lives in the expert-grouped buffer. Rows of expert e are
// [offsets[e], offsets[e+1]), in ascending token index.
struct DispatchLayout {
  int64_t N = 0, E = 0, S = 0, R = 0;  // tokens, experts, slots per token, rows
  std::vector<int64_t> counts;         // (E) rows per expert
  std::vector<int64_t> offsets;        // (E + 1)
  std::vector<int32_t> row_token;      // (R) token of each row
  std::vector<int32_t> row_slot;       // (R) slot of each row
  std::vector<int32_t> slot_row;       // (N, S) row of each slot, -1 for none
  std::vector<float> row_weight;       // (R) combine weight
};

// The layout of the assignments in r.expert with the weights r.weight.
void build_layout(DispatchLayout& layout, const Routing& r);

// xp (R, C): row r = inp[row_token[r]]. inp (N, C)
void permute_forward(float* xp, const float* inp, const DispatchLayout& layout, int64_t C);
// dinp (N, C) [+]= Σ over the token's rows of dxp, in slot order. dxp (R, C)
void permute_backward(float* dinp, const float* dxp, const DispatchLayout& layout, int64_t C,
                      bool accumulate);

// out (N, C) [+]= Σ over the token's slots, in slot order, of row_weight · y[row]. y (R, C).
// A token with no rows gets 0 (or keeps out when accumulating).
void combine_forward(float* out, const float* y, const DispatchLayout& layout, int64_t C,
                     bool accumulate);
// dy (R, C) = row_weight · dout[token]; dweight (N, S) = dout[token] · y[row], 0 on empty slots.
// dout (N, C), y (R, C)
void combine_backward(float* dy, float* dweight, const float* dout, const float* y,
                      const DispatchLayout& layout, int64_t C);

}  // namespace moetrain
