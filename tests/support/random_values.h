// Test support: n floats drawn from N(mean, stddev²) by std::mt19937 seeded with `seed`, the same
// sequence on every machine that shares the standard library's normal_distribution.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace moetrain::testing {

inline std::vector<float> normal(int64_t n, uint32_t seed, float stddev = 1.0f, float mean = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

}  // namespace moetrain::testing
