#include "core/rng.h"

#include <cmath>

namespace moetrain {

namespace {
constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;

inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = uint64_t(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

uint64_t rng_stream(RngPurpose purpose, uint64_t step, uint64_t rank) {
  uint64_t h = splitmix64(static_cast<uint64_t>(purpose));
  h = splitmix64(h ^ step);
  return splitmix64(h ^ (rank * 0x2545F4914F6CDD1Dull));
}

std::array<uint32_t, 4> Rng::block(uint64_t counter) const {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = static_cast<uint32_t>(stream_), c3 = static_cast<uint32_t>(stream_ >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed_), k1 = static_cast<uint32_t>(seed_ >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, c0, hi0, lo0);
    mulhilo(kMul1, c2, hi1, lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {c0, c1, c2, c3};
}

uint64_t Rng::below(uint64_t index, uint64_t n) const {
  // Lemire's multiply-shift on 64 bits; n < 2^32 in all our uses.
  unsigned __int128 p = static_cast<unsigned __int128>(u64(index)) * n;
  return static_cast<uint64_t>(p >> 64);
}

float Rng::normal(uint64_t index) const {
  auto b = block(index >> 1);
  uint32_t a = (index & 1) ? b[2] : b[0];
  uint32_t c = (index & 1) ? b[3] : b[1];
  // u1 in (0, 1] so that log never sees 0.
  double u1 = (static_cast<double>(a >> 8) + 1.0) * 0x1.0p-24;
  double u2 = static_cast<double>(c >> 8) * 0x1.0p-24;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}

void rng_fill_uniform(float* out, int64_t n, const Rng& rng, float lo, float hi, uint64_t offset) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = lo + (hi - lo) * rng.uniform(offset + i);
}

void rng_fill_normal(float* out, int64_t n, const Rng& rng, float mean, float stddev,
                     uint64_t offset) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = mean + stddev * rng.normal(offset + i);
}

}  // namespace moetrain
