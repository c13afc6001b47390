// Test support for distributed runs: which values of the flat parameter buffer a rank holds (all
// but the experts other ranks own, which it never updates), and how many of those differ in
// their bits between two runs.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "model/params.h"

namespace moetrain::testing {

// 1 where the trainer's rank holds the value. Trainer: anything with model().layout() and
// own_expert_ranges() (the LM and the classifier trainer).
template <class Trainer>
std::vector<char> held_values(Trainer& t) {
  const auto& params = t.model().layout().params();
  std::vector<char> held(static_cast<std::size_t>(t.params().size()), 1);
  for (const ParamInfo& p : params)
    if (p.expert >= 0) std::fill_n(held.begin() + p.offset, p.numel, 0);
  for (auto [offset, size] : t.own_expert_ranges()) std::fill_n(held.begin() + offset, size, 1);
  return held;
}

// Values held (held[i] set) whose bits differ between a and b.
inline int64_t differ_held(const std::vector<float>& a, const std::vector<float>& b,
                           const std::vector<char>& held) {
  int64_t n = 0;
  for (std::size_t i = 0; i < held.size(); ++i)
    n += held[i] && std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

// The largest difference over the held values of a from b, over b's largest magnitude there.
inline double max_rel_diff_held(const std::vector<float>& a, const std::vector<float>& b,
                                const std::vector<char>& held) {
  double worst = 0, scale = 1e-30;
  for (std::size_t i = 0; i < held.size(); ++i) {
    if (!held[i]) continue;
    worst = std::max(worst, std::abs(double(a[i]) - b[i]));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return worst / scale;
}

}  // namespace moetrain::testing
