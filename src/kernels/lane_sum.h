// A sum in double of n terms as 8 interleaved partial sums (lane j takes the terms i ≡ j mod 8),
// added pairwise at the end. The 8 chains are independent, so the compiler keeps them in vector
// registers instead of waiting on one chain's latency per term (a row sum of a 128-wide row ran
// 4x faster than the single chain); the order depends only on n, never on the instruction set
// or the thread count, so the result's bits do not either (the build does not contract FMAs:
// cmake/warnings.cmake).
#pragma once

#include <cstdint>

namespace moetrain {

template <class Term>
[[gnu::always_inline]] inline double lane_sum8(int64_t n, Term term) {
  double acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += term(i + j);
  }
  for (int j = 0; i + j < n; ++j) acc[j] += term(i + j);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

}  // namespace moetrain
