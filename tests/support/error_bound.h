// Test support: forward error bounds for float kernels checked against double references.
//
// oneDNN picks its kernels by instruction set (SSE4.1, AVX2, AVX-512, AVX512_BF16, ...), and
// they sum in different orders and blockings, so a float result is only known to lie within a
// bound of the exact value; two different primitives agree only within the sum of their bounds.
// The bounds follow the standard model fl(x op y) = (x op y)(1 + δ), |δ| ≤ u (Higham, "Accuracy
// and Stability of Numerical Algorithms", ch. 3): an n-term dot product summed in ANY order, with
// or without fused multiply-adds, satisfies
//   |fl(Σ a_i b_i) − Σ a_i b_i| ≤ γ_n Σ |a_i||b_i|,   γ_n = n·u / (1 − n·u),
// so the reference carries Σ|a_i||b_i| alongside each value. The references run in double,
// whose own error (u = 2^-53) is 2^29 times smaller and left out.
//
// Operands that the kernel rounds first (bf16 / fp16 GEMM inputs) enter as values with an error
// of their own, u_lp·|x|; the products of two rounded bf16 or fp16 values are exact in f32, so
// the accumulation is still an f32 one (u = 2^-24) over the rounded operands.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace moetrain::testing {

// Unit roundoff (half an ulp of 1) of each format.
inline constexpr double kUnitF32 = 0x1p-24;
inline constexpr double kUnitBf16 = 0x1p-8;  // 8-bit significand
inline constexpr double kUnitF16 = 0x1p-11;  // 11-bit significand
// Kernels that flush subnormals (AVX512_BF16's dot-product instruction does) may lose up to the
// smallest normal f32 per term.
inline constexpr double kF32MinNormal = 0x1p-126;
// Error of the float libm functions the kernels call (expf, logf, log1pf), in units of u: 4 ulp,
// the accuracy glibc specifies for its vector versions; its scalar ones measure within 1 ulp.
inline constexpr int64_t kLibmUnits = 8;

inline double gamma_n(int64_t n, double u = kUnitF32) {
  const double nu = static_cast<double>(n) * u;
  return nu / (1.0 - nu);
}

// A reference value v and a bound e on how far a float computation of the same expression may
// lie from it, whatever its summation order.
struct Bounded {
  double v = 0, e = 0;
  // The most the float computation's |value| can be.
  double mag() const { return std::abs(v) + e; }
};

// An operand that the kernel rounds to a format of unit roundoff u before using it.
inline Bounded rounded_operand(double x, double u) {
  return {x, u * std::abs(x)};
}

// Σ of terms a_i·b_i (and lone terms, such as the C that a GEMM accumulates into or a bias),
// computed in float in an unknown order from operands that carry their own error bounds.
class BoundedSum {
 public:
  explicit BoundedSum(double u = kUnitF32) : u_(u) {}
  void add(Bounded a, Bounded b) {
    v_ += a.v * b.v;
    carried_ += std::abs(a.v) * b.e + std::abs(b.v) * a.e + a.e * b.e;
    abs_ += a.mag() * b.mag();
    ++n_;
  }
  void add(double a, double b) { add(Bounded{a, 0}, Bounded{b, 0}); }
  void add(Bounded x) {
    v_ += x.v;
    carried_ += x.e;
    abs_ += x.mag();
    ++n_;
  }
  // The operands' errors carried through, plus the rounding of the n products and sums.
  Bounded result() const { return {v_, carried_ + gamma_n(n_, u_) * abs_ + n_ * kF32MinNormal}; }
  double value() const { return v_; }
  // Σ|a_i||b_i| of the computed operands: the quantity γ_n scales.
  double abs_sum() const { return abs_; }
  int64_t terms() const { return n_; }

 private:
  double u_;
  double v_ = 0, carried_ = 0, abs_ = 0;
  int64_t n_ = 0;
};

// x·y in float from computed x and y.
inline Bounded mul(Bounded x, Bounded y, double u = kUnitF32) {
  return {x.v * y.v, std::abs(x.v) * y.e + std::abs(y.v) * x.e + x.e * y.e + u * x.mag() * y.mag()};
}

// f(x) by a float kernel from a computed x: `slope` bounds |f'| between x.v − x.e and x.v + x.e,
// `rel` is the kernel's own relative error for an exact argument.
inline Bounded apply(Bounded x, double fx, double slope, double rel) {
  const double carried = slope * x.e;
  return {fx, carried + rel * (std::abs(fx) + carried)};
}

// Every |got_i − ref_i.v| ≤ ref_i.e. Reports the worst element with its error and its bound.
inline void expect_within(const float* got, const Bounded* ref, int64_t n, const char* what = "") {
  double worst = 0;
  int64_t at = -1;
  for (int64_t i = 0; i < n; ++i) {
    const double err = std::abs(double(got[i]) - ref[i].v);
    const double ratio = err == 0 ? 0 : err / ref[i].e;
    if (!(ratio <= worst)) worst = ratio, at = i;  // NaN lands here too
  }
  if (at < 0) return;
  EXPECT_LE(worst, 1.0) << what << ": worst element " << at << " got " << got[at] << " want "
                        << ref[at].v << " error " << std::abs(double(got[at]) - ref[at].v)
                        << " bound " << ref[at].e;
}
inline void expect_within(const std::vector<float>& got, const std::vector<Bounded>& ref,
                          const char* what = "") {
  ASSERT_EQ(got.size(), ref.size()) << what;
  expect_within(got.data(), ref.data(), static_cast<int64_t>(got.size()), what);
}

inline void expect_within(double got, Bounded ref, const char* what = "") {
  EXPECT_LE(std::abs(got - ref.v), ref.e)
      << what << ": got " << got << " want " << ref.v << " bound " << ref.e;
}

// How many |got_i − ref_i.v| exceed ref_i.e: for checking that a bound is tight enough to catch
// a wrong result (a reference with a bug put in must be missed by the correct result).
inline int64_t count_outside(const float* got, const Bounded* ref, int64_t n) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += !(std::abs(double(got[i]) - ref[i].v) <= ref[i].e);
  return count;
}

// Two float computations of the same values (two primitives, or two instruction sets) agree
// within the sum of their bounds: |a_i − b_i| ≤ bound_a_i + bound_b_i.
inline void expect_agree(const float* a, const float* b, const double* bound, int64_t n,
                         const char* what = "") {
  double worst = 0;
  int64_t at = -1;
  for (int64_t i = 0; i < n; ++i) {
    const double err = std::abs(double(a[i]) - double(b[i]));
    const double ratio = err == 0 ? 0 : err / bound[i];
    if (!(ratio <= worst)) worst = ratio, at = i;
  }
  if (at < 0) return;
  EXPECT_LE(worst, 1.0) << what << ": worst element " << at << " " << a[at] << " vs " << b[at]
                        << " bound " << bound[at];
}

// Both computed within ref's bounds, so within twice them of each other.
inline void expect_agree(const float* a, const float* b, const std::vector<Bounded>& ref,
                         const char* what = "") {
  std::vector<double> bound(ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) bound[i] = 2 * ref[i].e;
  expect_agree(a, b, bound.data(), static_cast<int64_t>(ref.size()), what);
}

}  // namespace moetrain::testing
