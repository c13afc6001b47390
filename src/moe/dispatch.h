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

// model.overflow = reroute, after apply_capacity: the load-aware assignment that replaces
// dropping. The dropped assignments are taken one at a time, by descending Routing::weight (the
// router's weight of that slot), ties to the lower slot index t·S + s, so that a token the
// router is surer of gets the room left first; each goes to the first expert in its token's
// order — descending key[t, :], ties to the lower expert index — that none of the token's slots
// already stands for (weight_expert), whose key is not −inf, and that holds fewer than
// `capacity` assignments at that moment. With no such expert it stays dropped. Experts keep what
// apply_capacity kept, so none ends over `capacity`. key (N, E) is the router's selection key
// (router_selection_keys), so a token's next-best expert is the one its top-K would have taken
// next, within its kept groups.
// Every token that got a new expert then has its weights recomputed by the router's rule over
// the experts they stand for: w_k = score[t, weight_expert_k] (/ Σ_j score[t, weight_expert_j]
// when normalising), a dropped slot still counting in the sum as under dropping. The weights stay
// the router's function of its scores, so router_backward is exact. score (N, E) is
// RouterCache::probs. Returns how many assignments were rerouted (the dropped count of
// apply_capacity minus it is what stays dropped).
int64_t reroute_overflow(Routing& r, int64_t capacity, const float* key, const float* score,
                         bool normalize);

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
