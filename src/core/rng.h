// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011). A number is a pure
// function of (seed, stream, index): no hidden state, so the output is the same whatever the
// thread count or the order in which indices are drawn, and a resumed run needs only its step.
#pragma once
#include <array>
#include <cstdint>

namespace moetrain {

// What a stream is for; part of the stream id so that purposes never share numbers.
enum class RngPurpose : uint32_t {
  Init = 1,
  Data = 2,
  Dropout = 3,
  RouterNoise = 4,
  Sample = 5,
  Test = 6,
  Gating = 7,
  PsWait = 8  // parameter-server mode: half_sync's waits
};

// A stream id from (purpose, step, rank): distinct inputs give distinct, well-mixed ids.
uint64_t rng_stream(RngPurpose purpose, uint64_t step, uint64_t rank);

class Rng {
 public:
  Rng(uint64_t seed, uint64_t stream) : seed_(seed), stream_(stream) {}

  // Four 32-bit words for block `counter`.
  std::array<uint32_t, 4> block(uint64_t counter) const;
  uint32_t u32(uint64_t index) const { return block(index >> 2)[index & 3]; }
  uint64_t u64(uint64_t index) const {
    auto b = block(index >> 1);
    return (index & 1) ? (uint64_t(b[3]) << 32 | b[2]) : (uint64_t(b[1]) << 32 | b[0]);
  }
  // Uniform in [0, 1) with 24 random bits.
  float uniform(uint64_t index) const { return static_cast<float>(u32(index) >> 8) * 0x1.0p-24f; }
  // Uniform integer in [0, n) (n > 0), from 64 bits: bias below 2^-32 for any n < 2^32.
  uint64_t below(uint64_t index, uint64_t n) const;
  // Standard normal (Box-Muller on one Philox block per pair of indices).
  float normal(uint64_t index) const;

  uint64_t seed() const { return seed_; }
  uint64_t stream() const { return stream_; }

 private:
  uint64_t seed_;
  uint64_t stream_;
};

// out[i] = value number (offset + i): identical for any OpenMP thread count.
void rng_fill_uniform(float* out, int64_t n, const Rng& rng, float lo, float hi,
                      uint64_t offset = 0);
void rng_fill_normal(float* out, int64_t n, const Rng& rng, float mean, float stddev,
                     uint64_t offset = 0);

}  // namespace moetrain
