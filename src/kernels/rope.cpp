#include "kernels/rope.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/profile.h"
#include "kernels/vec_math.h"

namespace moetrain {

namespace {
constexpr int64_t kParallelMin = 1 << 14;

void check_args(const char* fn, const int32_t* pos, int64_t N, int64_t NH, int64_t HS,
                int64_t max_pos) {
  MOETRAIN_CHECK(N >= 0 && NH >= 0, "{}: need N >= 0 and NH >= 0, got N={} NH={}", fn, N, NH);
  MOETRAIN_CHECK(HS > 0 && HS % 2 == 0, "{}: head size must be even and > 0, got HS={}", fn, HS);
  for (int64_t n = 0; n < N; ++n) {
    MOETRAIN_CHECK(pos[n] >= 0 && pos[n] < max_pos,
                   "{}: position of token {} is {}, expected [0, {})", fn, n, pos[n], max_pos);
  }
}

void check_theta(const char* fn, float theta) {
  MOETRAIN_CHECK(theta > 0.0f && std::isfinite(theta), "{}: theta must be finite and > 0, got {}",
                 fn, theta);
}

// inv_freq (HS/2), each step in float32 as transformers does it.
void inv_freq_f32(float* inv_freq, int64_t HS, float theta) {
  for (int64_t i = 0; i < HS / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(HS);
    inv_freq[i] = 1.0f / std::pow(theta, exponent);
  }
}

// cos, sin (HS/2) at one position. The angle is rounded to float32 first (as transformers does);
// its cos/sin then come from double so they are the correctly rounded float of that angle.
void cos_sin_at(float* cos_out, float* sin_out, int32_t pos, const float* inv_freq, int64_t half) {
  const float p = static_cast<float>(pos);
  for (int64_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(p * inv_freq[i]);
    cos_out[i] = static_cast<float>(std::cos(angle));
    sin_out[i] = static_cast<float>(std::sin(angle));
  }
}

// The AVX2 clone is picked at load time where the CPU has it; both do the same float operations
// lane by lane (no FMA contraction: cmake/warnings.cmake), so they agree bitwise.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOETRAIN_ROPE_HOT __attribute__((target_clones("avx2", "default")))
#else
#define MOETRAIN_ROPE_HOT
#endif

// Rotates every head of one token by +angle (sign = 1) or −angle (sign = −1, the backward: the
// transpose of a rotation is its inverse). Each pair is read before it is written, so out may be
// inp. Eight pairs at a time, the last HS/2 % 8 one by one: the same operations on every pair.
MOETRAIN_ROPE_HOT void rotate_token(float* out, const float* inp, const float* cos,
                                    const float* sin, int64_t NH, int64_t HS, float sign) {
  const int64_t half = HS / 2, hv = half / 8 * 8;
  for (int64_t h = 0; h < NH; ++h) {
    const float* x = inp + h * HS;
    float* y = out + h * HS;
    for (int64_t i = 0; i < hv; i += 8) {
      VF8 x1, x2, c, s;
      load_vf8(x1, x + i);
      load_vf8(x2, x + i + half);
      load_vf8(c, cos + i);
      load_vf8(s, sin + i);
      s = sign * s;
      const VF8 y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
      store_vf8(y + i, y1);
      store_vf8(y + i + half, y2);
    }
    for (int64_t i = hv; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      const float c = cos[i], s = sign * sin[i];
      y[i] = x1 * c - x2 * s;
      y[i + half] = x2 * c + x1 * s;
    }
  }
}

void rope_apply(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH, int64_t HS,
                float theta, float sign) {
  const int64_t half = HS / 2;
  std::vector<float> inv_freq(half);
  inv_freq_f32(inv_freq.data(), HS, theta);
  // A batch repeats positions (B sequences of T tokens use T): where there are fewer positions
  // than tokens, each position's cos/sin is computed once, the same values as token by token.
  int64_t positions = 0;
  for (int64_t n = 0; n < N; ++n) positions = std::max<int64_t>(positions, int64_t{pos[n]} + 1);
  if (positions < N) {
    std::vector<float> cos(positions * half), sin(positions * half);
    for (int64_t p = 0; p < positions; ++p)
      cos_sin_at(cos.data() + p * half, sin.data() + p * half, static_cast<int32_t>(p),
                 inv_freq.data(), half);
#pragma omp parallel for schedule(static) if (N * NH * HS > kParallelMin)
    for (int64_t n = 0; n < N; ++n) {
      rotate_token(out + n * NH * HS, inp + n * NH * HS, cos.data() + pos[n] * half,
                   sin.data() + pos[n] * half, NH, HS, sign);
    }
    return;
  }
#pragma omp parallel if (N * NH * HS > kParallelMin)
  {
    std::vector<float> cos(half), sin(half);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      cos_sin_at(cos.data(), sin.data(), pos[n], inv_freq.data(), half);
      rotate_token(out + n * NH * HS, inp + n * NH * HS, cos.data(), sin.data(), NH, HS, sign);
    }
  }
}

void rope_apply(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                const RopeTable& table, float sign) {
  const int64_t HS = table.head_size();
#pragma omp parallel for schedule(static) if (N * NH * HS > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    rotate_token(out + n * NH * HS, inp + n * NH * HS, table.cos_row(pos[n]), table.sin_row(pos[n]),
                 NH, HS, sign);
  }
}

void check_table(const char* fn, int64_t HS, const RopeTable& table) {
  MOETRAIN_CHECK(HS == table.head_size(), "{}: head size {} differs from the RopeTable's {}", fn,
                 HS, table.head_size());
}

// Positions are int32, and float(pos) must be exact for the angle to match.
constexpr int64_t kMaxPos = int64_t{1} << 24;
}  // namespace

void rope_forward(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                  int64_t HS, float theta) {
  PhaseScope phase_scope(Phase::Rope);
  check_theta("rope_forward", theta);
  check_args("rope_forward", pos, N, NH, HS, kMaxPos);
  rope_apply(out, inp, pos, N, NH, HS, theta, 1.0f);
}

void rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t N, int64_t NH,
                   int64_t HS, float theta) {
  PhaseScope phase_scope(Phase::Rope);
  check_theta("rope_backward", theta);
  check_args("rope_backward", pos, N, NH, HS, kMaxPos);
  rope_apply(dinp, dout, pos, N, NH, HS, theta, -1.0f);
}

RopeTable::RopeTable(int64_t max_pos, int64_t HS, float theta)
    : max_pos_(max_pos), hs_(HS), theta_(theta) {
  MOETRAIN_CHECK(max_pos >= 0 && max_pos <= kMaxPos,
                 "RopeTable: max_pos must be in [0, {}], got {}", kMaxPos, max_pos);
  MOETRAIN_CHECK(HS > 0 && HS % 2 == 0, "RopeTable: head size must be even and > 0, got HS={}", HS);
  check_theta("RopeTable", theta);
  const int64_t half = HS / 2;
  std::vector<float> inv_freq(half);
  inv_freq_f32(inv_freq.data(), HS, theta);
  cos_.resize(max_pos * half);
  sin_.resize(max_pos * half);
#pragma omp parallel for schedule(static) if (max_pos * half > kParallelMin)
  for (int64_t p = 0; p < max_pos; ++p) {
    cos_sin_at(cos_.data() + p * half, sin_.data() + p * half, static_cast<int32_t>(p),
               inv_freq.data(), half);
  }
}

void rope_forward(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                  int64_t HS, const RopeTable& table) {
  PhaseScope phase_scope(Phase::Rope);
  check_table("rope_forward", HS, table);
  check_args("rope_forward", pos, N, NH, HS, table.max_pos());
  rope_apply(out, inp, pos, N, NH, table, 1.0f);
}

void rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t N, int64_t NH,
                   int64_t HS, const RopeTable& table) {
  PhaseScope phase_scope(Phase::Rope);
  check_table("rope_backward", HS, table);
  check_args("rope_backward", pos, N, NH, HS, table.max_pos());
  rope_apply(dinp, dout, pos, N, NH, table, -1.0f);
}

}  // namespace moetrain
