#include "kernels/activation.h"

#include <algorithm>
#include <type_traits>

#include "core/bf16_round.h"
#include "core/cpu.h"
#include "core/profile.h"
#include "kernels/vec_math.h"

namespace moetrain {

namespace {
constexpr int64_t kParallelMin = 1 << 14;
// Elements per task of a parallel loop: a multiple of 16, so that only the array's end has a
// partial vector and an element's result does not depend on how the loop is cut.
constexpr int64_t kChunk = 4096;

// The AVX2 clone is picked at load time where the CPU has it; both do the same float operations
// (no FMA contraction: cmake/warnings.cmake), so they agree bitwise (as kernels/attention.cpp).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOETRAIN_ACT_HOT __attribute__((target_clones("avx2", "default")))
#else
#define MOETRAIN_ACT_HOT
#endif

// σ(x) = 1 / (1 + e^−x), e^x from exp_v (within 1 ulp of exp(x)).
template <class VF>
[[gnu::always_inline]] inline void sigmoid_v(VF& s, const VF& x) {
  VF e = -x;
  exp_v(e, e);
  s = 1.0f / (1.0f + e);
}
[[gnu::always_inline]] inline void sigmoid8(VF8& s, const VF8& x) {
  sigmoid_v(s, x);
}

// Stores a vector's lanes at p: as they are, or rounded as bf16(float) / fp16(float) round them.
template <class VF>
[[gnu::always_inline]] inline void store_out(float* p, const VF& v) {
  store_v(p, v);
}
template <class VF>
[[gnu::always_inline]] inline void store_out(bf16* p, const VF& v) {
  // bf16(float) lane by lane: round to nearest even, NaN kept quiet (core/dtype.h).
  using VI = typename IntVec<VF>::type;
  constexpr int kLanes = sizeof(VF) / sizeof(float);
  typedef uint16_t VH __attribute__((vector_size(kLanes * 2)));
  VI u, r;
  std::memcpy(&u, &v, sizeof u);
  const VI nan = (u & 0x7fffffff) > 0x7f800000;
  r = (u + (0x7fff + ((u >> 16) & 1))) >> 16;
  r = nan ? ((u >> 16) | 0x40) : r;
  const VH h = __builtin_convertvector(r, VH);
  std::memcpy(static_cast<void*>(p), &h, sizeof h);
}
template <class VF>
[[gnu::always_inline]] inline void store_out(fp16* p, const VF& v) {
  constexpr int kLanes = sizeof(VF) / sizeof(float);
  float buf[kLanes];
  store_v(buf, v);
  for (int k = 0; k < kLanes; ++k) p[k] = fp16(buf[k]);
}
template <class Out>
[[gnu::always_inline]] inline void store8(Out* p, const VF8& v) {
  store_out(p, v);
}

// The first n < 8 elements of p as a vector, zeros after them.
[[gnu::always_inline]] inline void load_part(VF8& v, const float* p, int64_t n) {
  float buf[8] = {};
  std::memcpy(buf, p, static_cast<std::size_t>(n) * sizeof(float));
  load_vf8(v, buf);
}
// The first n < 8 lanes of v stored at p.
template <class Out>
[[gnu::always_inline]] inline void store_part(Out* p, const VF8& v, int64_t n) {
  Out buf[8];
  store8(buf, v);
  std::memcpy(p, buf, static_cast<std::size_t>(n) * sizeof(Out));
}

[[gnu::always_inline]] inline void silu_forward8(VF8& y, const VF8& x) {
  VF8 s;
  sigmoid8(s, x);
  y = x * s;
}

// d/dx [x·σ(x)] = σ(x)·(1 + x·(1 − σ(x)))
[[gnu::always_inline]] inline void silu_backward8(VF8& dx, const VF8& dy, const VF8& x) {
  VF8 s;
  sigmoid8(s, x);
  dx = dy * (s * (1.0f + x * (1.0f - s)));
}

template <class VF>
[[gnu::always_inline]] inline void swiglu_forward_v(VF& y, const VF& a, const VF& b) {
  VF s;
  sigmoid_v(s, a);
  y = a * s * b;
}
[[gnu::always_inline]] inline void swiglu_forward8(VF8& y, const VF8& a, const VF8& b) {
  swiglu_forward_v(y, a, b);
}

template <class VF>
[[gnu::always_inline]] inline void swiglu_backward_v(VF& da, VF& db, const VF& d, const VF& a,
                                                     const VF& b) {
  VF s;
  sigmoid_v(s, a);
  const VF silu = a * s;
  da = d * b * s * (1.0f + a * (1.0f - s));
  db = d * silu;
}
[[gnu::always_inline]] inline void swiglu_backward8(VF8& da, VF8& db, const VF8& d, const VF8& a,
                                                    const VF8& b) {
  swiglu_backward_v(da, db, d, a, b);
}

// Each range function runs whole vectors, then the last n % 8 elements on zero-padded copies
// through the same operations.
MOETRAIN_ACT_HOT void silu_forward_range(float* out, const float* inp, int64_t n) {
  int64_t i = 0;
  VF8 x, y;
  for (; i + 8 <= n; i += 8) {
    load_vf8(x, inp + i);
    silu_forward8(y, x);
    store8(out + i, y);
  }
  if (i == n) return;
  load_part(x, inp + i, n - i);
  silu_forward8(y, x);
  store_part(out + i, y, n - i);
}

MOETRAIN_ACT_HOT void silu_backward_range(float* dinp, const float* dout, const float* inp,
                                          int64_t n) {
  int64_t i = 0;
  VF8 d, x, y;
  for (; i + 8 <= n; i += 8) {
    load_vf8(d, dout + i);
    load_vf8(x, inp + i);
    silu_backward8(y, d, x);
    store8(dinp + i, y);
  }
  if (i == n) return;
  load_part(d, dout + i, n - i);
  load_part(x, inp + i, n - i);
  silu_backward8(y, d, x);
  store_part(dinp + i, y, n - i);
}

// One clone set per output type (target_clones takes no templates).
#define MOETRAIN_SWIGLU_RANGES(Out)                                                         \
  MOETRAIN_ACT_HOT void swiglu_forward_range(Out* out, const float* a, const float* b,    \
                                             int64_t n) {                                  \
    int64_t i = 0;                                                                          \
    VF8 av, bv, y;                                                                          \
    for (; i + 8 <= n; i += 8) {                                                            \
      load_vf8(av, a + i);                                                                  \
      load_vf8(bv, b + i);                                                                  \
      swiglu_forward8(y, av, bv);                                                           \
      store8(out + i, y);                                                                   \
    }                                                                                       \
    if (i == n) return;                                                                     \
    load_part(av, a + i, n - i);                                                            \
    load_part(bv, b + i, n - i);                                                            \
    swiglu_forward8(y, av, bv);                                                             \
    store_part(out + i, y, n - i);                                                          \
  }                                                                                         \
  MOETRAIN_ACT_HOT void swiglu_backward_range(Out* da, Out* db, const float* dout,        \
                                              const float* a, const float* b, int64_t n) { \
    int64_t i = 0;                                                                          \
    VF8 d, av, bv, ya, yb;                                                                  \
    for (; i + 8 <= n; i += 8) {                                                            \
      load_vf8(d, dout + i);                                                                \
      load_vf8(av, a + i);                                                                  \
      load_vf8(bv, b + i);                                                                  \
      swiglu_backward8(ya, yb, d, av, bv);                                                  \
      store8(da + i, ya);                                                                   \
      store8(db + i, yb);                                                                   \
    }                                                                                       \
    if (i == n) return;                                                                     \
    load_part(d, dout + i, n - i);                                                          \
    load_part(av, a + i, n - i);                                                            \
    load_part(bv, b + i, n - i);                                                            \
    swiglu_backward8(ya, yb, d, av, bv);                                                    \
    store_part(da + i, ya, n - i);                                                          \
    store_part(db + i, yb, n - i);                                                          \
  }
MOETRAIN_SWIGLU_RANGES(float)
MOETRAIN_SWIGLU_RANGES(bf16)
MOETRAIN_SWIGLU_RANGES(fp16)
#undef MOETRAIN_SWIGLU_RANGES

// Where the CPU has AVX-512, SwiGLU runs 16 lanes at a time (half the instructions of 8 lanes:
// 1.4x the rate on this CPU), each lane through the same operations as the 8-lane code, which
// takes the last n % 16 elements: the results are the same bits either way.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOETRAIN_ACT_WIDE 1
// The 16-lane loops, built for `target` and storing with `store(p, v, flags)` (name: the
// functions' suffix). A store may leave a vector's rounding to be done again (flags set: the
// AVX512_BF16 store below, for subnormal results); a range that set any is stored again by the
// AVX-512 loops, which round by the integer rule: the same bits.
#define MOETRAIN_SWIGLU_WIDE(Out, target, name, store)                                      \
  target void swiglu_forward_##name(Out* out, const float* a, const float* b, int64_t n) {  \
    int64_t i = 0;                                                                          \
    unsigned flags = 0;                                                                     \
    VF16 av, bv, y;                                                                         \
    for (; i + 16 <= n; i += 16) {                                                          \
      load_v(av, a + i);                                                                    \
      load_v(bv, b + i);                                                                    \
      swiglu_forward_v(y, av, bv);                                                          \
      store(out + i, y, flags);                                                             \
    }                                                                                       \
    if (flags) swiglu_forward_wide(out, a, b, i);                                           \
    if (i < n) swiglu_forward_range(out + i, a + i, b + i, n - i);                          \
  }                                                                                         \
  target void swiglu_backward_##name(Out* da, Out* db, const float* dout, const float* a,   \
                                     const float* b, int64_t n) {                           \
    int64_t i = 0;                                                                          \
    unsigned flags = 0;                                                                     \
    VF16 d, av, bv, ya, yb;                                                                 \
    for (; i + 16 <= n; i += 16) {                                                          \
      load_v(d, dout + i);                                                                  \
      load_v(av, a + i);                                                                    \
      load_v(bv, b + i);                                                                    \
      swiglu_backward_v(ya, yb, d, av, bv);                                                 \
      store(da + i, ya, flags);                                                             \
      store(db + i, yb, flags);                                                             \
    }                                                                                       \
    if (flags) swiglu_backward_wide(da, db, dout, a, b, i);                                 \
    if (i < n) swiglu_backward_range(da + i, db + i, dout + i, a + i, b + i, n - i);        \
  }
// The AVX-512 loops round by store_out's integer rule, exact for every lane (no flags).
template <class T>
[[gnu::always_inline]] inline void store_exact(T* p, const VF16& v, unsigned&) {
  store_out(p, v);
}
#define MOETRAIN_AVX512F __attribute__((target("avx512f")))
MOETRAIN_SWIGLU_WIDE(float, MOETRAIN_AVX512F, wide, store_exact)
MOETRAIN_SWIGLU_WIDE(bf16, MOETRAIN_AVX512F, wide, store_exact)
MOETRAIN_SWIGLU_WIDE(fp16, MOETRAIN_AVX512F, wide, store_exact)
#undef MOETRAIN_AVX512F

// bf16 outputs on CPUs with AVX512_BF16: the same loops with each result rounded by
// vcvtneps2bf16 (core/bf16_round.h: the same bits as the integer rounding, in one instruction
// instead of ten), subnormal results looked for once a range (store_bf16x16_flagged).
MOETRAIN_BF16_TARGET [[gnu::always_inline]] inline void store_bf16_hw(bf16* p, const VF16& v,
                                                                     unsigned& flags) {
  store_bf16x16_flagged(p, (__m512)v, flags);
}
MOETRAIN_SWIGLU_WIDE(bf16, MOETRAIN_BF16_TARGET, bf16, store_bf16_hw)
#undef MOETRAIN_SWIGLU_WIDE
#endif

bool use_wide() {
#ifdef MOETRAIN_ACT_WIDE
  return cpu_has_avx512f();
#else
  return false;
#endif
}

// f(i0, len) over [0, n) in chunks of kChunk, in parallel when n is large enough.
template <class F>
void for_chunks(int64_t n, F f) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i0 = c * kChunk;
    f(i0, std::min(kChunk, n - i0));
  }
}
}  // namespace

void silu_forward(float* out, const float* inp, int64_t n) {
  PhaseScope phase_scope(Phase::Activation);
  for_chunks(n, [&](int64_t i, int64_t m) { silu_forward_range(out + i, inp + i, m); });
}

void silu_backward(float* dinp, const float* dout, const float* inp, int64_t n) {
  PhaseScope phase_scope(Phase::Activation);
  for_chunks(n,
             [&](int64_t i, int64_t m) { silu_backward_range(dinp + i, dout + i, inp + i, m); });
}

namespace {
template <class Out>
void swiglu_forward_impl(Out* out, const float* a, const float* b, int64_t n) {
  PhaseScope phase_scope(Phase::Activation);
  const bool wide = use_wide();
  [[maybe_unused]] const bool bf16_hw = cpu_has_avx512_bf16();
  for_chunks(n, [&](int64_t i, int64_t m) {
#ifdef MOETRAIN_ACT_WIDE
    if constexpr (std::is_same_v<Out, bf16>)
      if (bf16_hw) return swiglu_forward_bf16(out + i, a + i, b + i, m);
    if (wide) return swiglu_forward_wide(out + i, a + i, b + i, m);
#endif
    swiglu_forward_range(out + i, a + i, b + i, m);
  });
}

template <class Out>
void swiglu_backward_impl(Out* da, Out* db, const float* dout, const float* a, const float* b,
                          int64_t n) {
  PhaseScope phase_scope(Phase::Activation);
  const bool wide = use_wide();
  [[maybe_unused]] const bool bf16_hw = cpu_has_avx512_bf16();
  for_chunks(n, [&](int64_t i, int64_t m) {
#ifdef MOETRAIN_ACT_WIDE
    if constexpr (std::is_same_v<Out, bf16>)
      if (bf16_hw) return swiglu_backward_bf16(da + i, db + i, dout + i, a + i, b + i, m);
    if (wide) return swiglu_backward_wide(da + i, db + i, dout + i, a + i, b + i, m);
#endif
    swiglu_backward_range(da + i, db + i, dout + i, a + i, b + i, m);
  });
}
}  // namespace

void swiglu_forward(float* out, const float* a, const float* b, int64_t n) {
  swiglu_forward_impl(out, a, b, n);
}
void swiglu_forward(bf16* out, const float* a, const float* b, int64_t n) {
  swiglu_forward_impl(out, a, b, n);
}
void swiglu_forward(fp16* out, const float* a, const float* b, int64_t n) {
  swiglu_forward_impl(out, a, b, n);
}

void swiglu_backward(float* da, float* db, const float* dout, const float* a, const float* b,
                     int64_t n) {
  swiglu_backward_impl(da, db, dout, a, b, n);
}
void swiglu_backward(bf16* da, bf16* db, const float* dout, const float* a, const float* b,
                     int64_t n) {
  swiglu_backward_impl(da, db, dout, a, b, n);
}
void swiglu_backward(fp16* da, fp16* db, const float* dout, const float* a, const float* b,
                     int64_t n) {
  swiglu_backward_impl(da, db, dout, a, b, n);
}

}  // namespace moetrain
