// exp over 8 floats at a time, with GCC vector extensions, for the softmaxes of attention and of
// the cross-entropy and for the SiLU/SwiGLU activations; and a row's maximum, for both softmaxes.
//
// Only IEEE additions, multiplications, comparisons and integer operations on the bits, in a fixed
// order, so that a function that inlines it gives the same bits whatever instruction set it is
// compiled for (the build turns FMA contraction off: cmake/warnings.cmake), and one element's
// result does not depend on its neighbours. A loop whose length is not a multiple of 8 runs its
// tail through the same function (exp_tail), so an element's result does not depend on where it
// sits in a row either. The 16-lane form for AVX-512 code reaches the same bits with that
// instruction set's min, max, rounding and scaling instructions (exp_v(VF16&, ...) below).
//
// Accuracy (tests/kernels/vec_math_test.cpp checks it against exp in double): where e^x is a
// normal float (x in [-87.33, 88.72]) the result is less than 1 ulp from e^x (0.990 ulp at worst
// over every float, so at most 1 ulp from the correctly rounded result); below that it is a
// subnormal within 0.75 of a step of 2^-149 from e^x, 0 for x <= -104 and x = -inf; +inf where
// e^x > FLT_MAX (x > 88.7228) and for x = +inf; NaN stays NaN.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>  // declares the AVX-512 builtins exp_v(VF16) uses
#endif


namespace moetrain {

typedef float VF8 __attribute__((vector_size(32)));
typedef int32_t VI8 __attribute__((vector_size(32)));
// 16 lanes, for code built for AVX-512 (the same operations lane by lane as 8 lanes).
typedef float VF16 __attribute__((vector_size(64)));
typedef int32_t VI16 __attribute__((vector_size(64)));

// The integer vector of a float vector's width.
template <class VF>
struct IntVec;
template <>
struct IntVec<VF8> {
  using type = VI8;
};
template <>
struct IntVec<VF16> {
  using type = VI16;
};

// Vectors go in and out by reference: passing one by value is ABI-dependent (-Wpsabi) in a
// function built for baseline x86-64.
template <class VF>
[[gnu::always_inline]] inline void load_v(VF& v, const float* p) {
  std::memcpy(&v, p, sizeof v);
}
template <class VF>
[[gnu::always_inline]] inline void store_v(float* p, const VF& v) {
  std::memcpy(p, &v, sizeof v);
}
[[gnu::always_inline]] inline void load_vf8(VF8& v, const float* p) {
  load_v(v, p);
}
[[gnu::always_inline]] inline void store_vf8(float* p, const VF8& v) {
  store_v(p, v);
}

// e^x = 2^n · e^r with n = round(x / ln 2) and r = x − n·ln 2 in [−ln2/2, ln2/2] (Cody–Waite: ln 2
// split in a part with 9 significant bits, so n·ln2_hi is exact for |n| < 2^15, and the rest);
// e^r from Cephes' expf polynomial (1 + r + r²·P(r), P of degree 5); 2^n applied as two powers
// of two, each a normal float, so that results that overflow or fall into the subnormals are
// rounded once, by the last multiplication.
// e^r for r = x − n·ln 2 (both forms of exp_v below): the range reduction and the polynomial.
template <class VF>
[[gnu::always_inline]] inline void exp_reduced(VF& y, const VF& x, const VF& n) {
  const VF r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  VF p = VF{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  y = (p * (r * r) + r) + 1.0f;
}

template <class VF>
[[gnu::always_inline]] inline void exp_v(VF& y, const VF& in) {
  using VI = typename IntVec<VF>::type;
  // Past these bounds the result is +inf or 0 already; clamping keeps n in [-150, 128]. A NaN
  // fails both comparisons and stays NaN.
  const VF hi = VF{} + 89.0f, lo = VF{} - 104.0f;
  VF x = in > hi ? hi : in;
  x = x < lo ? lo : x;
  // Adding 1.5·2^23 rounds x/ln2 to an integer (ties to even) in the low bits of t.
  const VF magic = VF{} + 12582912.0f;
  const VF t = x * 1.44269504088896341f + magic;
  const VF n = t - magic;
  VI ni, mb;
  std::memcpy(&ni, &t, sizeof ni);
  std::memcpy(&mb, &magic, sizeof mb);
  ni -= mb;
  exp_reduced(y, x, n);
  const VI n1 = ni >> 1, n2 = ni - n1;
  const VI b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  VF s1, s2;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  y = (y * s1) * s2;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// The 16-lane form, for code built for AVX-512: the same value in every lane as the template's,
// in a third fewer instructions. The clamps are vminps / vmaxps with the bound first (a NaN lane
// takes the second operand, so it stays NaN, as the comparisons leave it); n is x / ln 2 rounded
// to the nearest integer, ties to even, by vrndscaleps, which the magic addition computes too
// (|x / ln 2| < 2^22; the sign of a zero n changes nothing below); and vscalefps multiplies by
// 2^n with one rounding, which the two powers of two do as well. GCC's builtins rather than the
// intrinsics: those carry a target attribute of their own and cannot be inlined through the
// templates that call this, while a builtin needs AVX-512 only where it finally lands, in the
// caller built for it (the ABI warning is about passing such vectors by value, which an inlined
// body never does).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
[[gnu::always_inline]] inline void exp_v(VF16& y, const VF16& in) {
  constexpr unsigned short kAll = 0xffff;
  constexpr int kCurrent = 4;  // _MM_FROUND_CUR_DIRECTION
  constexpr int kNearest = 8;  // _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC
  VF16 x = __builtin_ia32_minps512_mask(VF16{} + 89.0f, in, in, kAll, kCurrent);
  x = __builtin_ia32_maxps512_mask(VF16{} - 104.0f, x, x, kAll, kCurrent);
  const VF16 t = x * 1.44269504088896341f;
  const VF16 n = __builtin_ia32_rndscaleps_mask(t, kNearest, t, kAll, kCurrent);
  exp_reduced(y, x, n);
  y = __builtin_ia32_scalefps512_mask(y, n, y, kAll, kCurrent);
}
#pragma GCC diagnostic pop
#endif

[[gnu::always_inline]] inline void exp_vf8(VF8& y, const VF8& in) {
  exp_v(y, in);
}

// exp of p[0..n) into q[0..n) for n < 8, through exp_vf8 (the lanes past n compute exp(0)).
[[gnu::always_inline]] inline void exp_tail(float* q, const float* p, int64_t n) {
  float buf[8] = {};
  std::memcpy(buf, p, sizeof(float) * static_cast<std::size_t>(n));
  VF8 v;
  load_vf8(v, buf);
  exp_vf8(v, v);
  store_vf8(buf, v);
  std::memcpy(q, buf, sizeof(float) * static_cast<std::size_t>(n));
}

// The scalar form: the same bits as a lane of exp_vf8.
[[gnu::always_inline]] inline float exp_f32(float x) {
  float y;
  exp_tail(&y, &x, 1);
  return y;
}

// log x over four doubles, for the sums of a softmax's exponentials (in [1, n]: the largest term is
// 1): x = 2^e·f with f in [√½, √2), log f = 2·atanh(s) with s = (f − 1) / (f + 1), |s| < 0.1716,
// summed to s^21 (the rest is under 2^-58 of log f), plus e·ln 2. Where x is not a normal
// positive double the lane is NaN; the caller takes std::log there. Only IEEE operations and
// integer operations on the bits, so the same bits on every instruction set.
typedef double VD4 __attribute__((vector_size(32)));
typedef int64_t VL4 __attribute__((vector_size(32)));
[[gnu::always_inline]] inline void log_vd4(VD4& y, const VD4& x) {
  VL4 bits;
  std::memcpy(&bits, &x, sizeof bits);
  VL4 e = (bits >> 52) - 1023;
  const VL4 mb = (bits & 0x000fffffffffffffLL) | 0x3ff0000000000000LL;
  VD4 f;
  std::memcpy(&f, &mb, sizeof f);
  const VL4 big = f > 1.4142135623730951;  // -1 where f ≥ √2: f halved, e one more
  f = big ? f * 0.5 : f;
  e -= big;
  const VD4 s = (f - 1.0) / (f + 1.0), s2 = s * s;
  VD4 p = VD4{} + 1.0 / 21;
  p = p * s2 + 1.0 / 19;
  p = p * s2 + 1.0 / 17;
  p = p * s2 + 1.0 / 15;
  p = p * s2 + 1.0 / 13;
  p = p * s2 + 1.0 / 11;
  p = p * s2 + 1.0 / 9;
  p = p * s2 + 1.0 / 7;
  p = p * s2 + 1.0 / 5;
  p = p * s2 + 1.0 / 3;
  const VD4 lf = (s + s) + (s + s) * (s2 * p);
  const VD4 ed = __builtin_convertvector(e, VD4);
  y = ed * 0.6931471805599453 + lf;
  const VL4 normal = (x >= 2.2250738585072014e-308) & (x <= 1.7976931348623157e308);
  y = normal ? y : VD4{} + std::numeric_limits<double>::quiet_NaN();
}

// acc[k] += x[4q + k] in double for the quarters q of x in order: a sum of a row's floats in four
// double lanes (each lane's terms in order, then the lanes folded by the caller) that gives the
// same bits whatever the width of the vectors the row is read in.
template <class VF>
[[gnu::always_inline]] inline void add_quarters(VD4& acc, const VF& x) {
  typedef double VD8 __attribute__((vector_size(64)));
  constexpr int kHalves = sizeof(VF) / sizeof(VF8);
  VF8 h[kHalves];
  std::memcpy(h, &x, sizeof x);
  for (int k = 0; k < kHalves; ++k) {
    const VD8 d = __builtin_convertvector(h[k], VD8);
    acc += __builtin_shufflevector(d, d, 0, 1, 2, 3);
    acc += __builtin_shufflevector(d, d, 4, 5, 6, 7);
  }
}

// max over x[0, n), NaNs passed over, as std::max in index order finds it: eight lanes, then the
// lanes folded. A maximum is exact whichever way it is taken; only the sign of a zero maximum can
// depend on the order, so that one case is taken again in order.
[[gnu::always_inline]] inline float row_max(const float* x, int64_t n) {
  const int64_t nv = n / 8 * 8;
  VF8 mv = VF8{} - std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < nv; j += 8) {
    VF8 y;
    load_vf8(y, x + j);
    mv = mv < y ? y : mv;
  }
  float m = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < 8; ++j) m = std::max(m, mv[j]);
  for (int64_t j = nv; j < n; ++j) m = std::max(m, x[j]);
  if (m != 0.0f) return m;
  m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

}  // namespace moetrain
