#include "kernels/attention_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/buffer.h"
#include "core/check.h"
#include "core/cpu.h"
#include "kernels/lane_sum.h"
#include "kernels/vec_math.h"

namespace moetrain {

namespace {

// The build targets baseline x86-64; the AVX2 clone is picked at load time where the CPU has it.
// Both clones do the same float operations in the same order ("avx2" does not enable FMA, so
// nothing gets contracted), so they agree bitwise.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOETRAIN_ROWS_HOT __attribute__((target_clones("avx2", "default")))
// Where the CPU has AVX-512 the rows run 16 lanes at a time: each lane through the same
// operations as the 8-lane code, so the same bits (Attention.RowsSameBitsOnEveryPath).
#define MOETRAIN_ROWS_WIDE 1
#define MOETRAIN_ROWS_AVX512 __attribute__((target("avx512f")))
#else
#define MOETRAIN_ROWS_HOT
#endif

// The exponentials go through exp_v (kernels/vec_math.h, within 1 ulp of exp), VF's lanes at a
// time: the softmax's over whole vectors up to its rows' widest, lanes past a row's end masked;
// the backward's rows then eight for the last columns of a row whose length is not a multiple of
// the width. Lanes are independent, so a score's result does not depend on where its row ends or
// on the width: a row's last partial vector reads whatever lies past the row's end (masked, or
// overwritten by its caller), or padded copies where the data itself ends.

// Lanes of v at or past `valid` set to `fill` (valid may exceed the width: then none), in place.
template <class VF>
[[gnu::always_inline]] inline void keep_lanes(VF& v, int64_t valid, float fill) {
  using VI = typename IntVec<VF>::type;
  constexpr int kLanes = sizeof(VF) / sizeof(float);
  VI lane;
  for (int k = 0; k < kLanes; ++k) lane[k] = k;
  const VI room = VI{} + static_cast<int32_t>(std::min<int64_t>(valid, kLanes));
  v = lane < room ? v : VF{} + fill;
}

// The largest lane of v (no lane is NaN), halving the vector: the lanes' maximum is the same
// whatever order it is taken in, bar the sign of a zero, which the caller takes again in order.
template <class VF>
[[gnu::always_inline]] inline float lanes_max(const VF& v) {
  typedef float VF4 __attribute__((vector_size(16)));
  VF8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  if constexpr (sizeof(VF) == sizeof(VF16)) {
    const VF8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    h = h < hi ? hi : h;
  }
  VF4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3);
  const VF4 q_hi = __builtin_shufflevector(h, h, 4, 5, 6, 7);
  q = q < q_hi ? q_hi : q;
  const float x = std::max(q[0], q[2]), y = std::max(q[1], q[3]);
  return std::max(x, y);
}

// kR rows of a block at once, row r of them from `row` + r · ld, seeing n[r] columns: each row
// in two passes over its VF vectors up to the group's widest, round_up(max n, lanes): scaled,
// with the largest scaled score over [0, n) taken as they go (a maximum is the same whatever the
// order: NaNs passed over, a zero maximum taken again in order for its sign); then
// exp(x − m), lanes at or past n zeroed, stored and summed in double in the order of four lanes
// of two halves (add_quarters, the same order at either width: a vector wholly past n adds
// zeros, which leave a sum of exponentials as it is), then the lanes in order. The rows' passes
// interleave: their sums are separate chains of additions, which one row alone leaves waiting on
// each other's latency.
template <class VF, int kR>
[[gnu::always_inline]] inline void softmax_group(RowSoftmax* sm, float* row, int64_t ld,
                                                 const int64_t* n, int64_t nk, float scale) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr int64_t kW = sizeof(VF) / sizeof(float);
  int64_t widest = 0;
  for (int r = 0; r < kR; ++r) widest = std::max(widest, n[r]);
  const int64_t nr = round_up(widest, kW);
  VF mw[kR];
  for (int r = 0; r < kR; ++r) mw[r] = VF{} - kInf;
  for (int64_t j = 0; j < nr; j += kW) {
    for (int r = 0; r < kR; ++r) {
      VF x;
      load_v(x, row + r * ld + j);
      x = x * scale;
      store_v(row + r * ld + j, x);
      keep_lanes(x, n[r] - j, -kInf);
      mw[r] = mw[r] < x ? x : mw[r];
    }
  }
  float m[kR];
  for (int r = 0; r < kR; ++r) {
    m[r] = lanes_max(mw[r]);
    if (m[r] == 0.0f) m[r] = row_max(row + r * ld, n[r]);
  }
  VD4 acc[kR];
  for (int r = 0; r < kR; ++r) acc[r] = VD4{};
  for (int64_t j = 0; j < nr; j += kW) {
    for (int r = 0; r < kR; ++r) {
      VF x;
      load_v(x, row + r * ld + j);
      x -= m[r];
      exp_v(x, x);
      keep_lanes(x, n[r] - j, 0.0f);
      store_v(row + r * ld + j, x);
      add_quarters(acc[r], x);
    }
  }
  for (int r = 0; r < kR; ++r) {
    if (nk > nr) std::fill(row + r * ld + nr, row + r * ld + nk, 0.0f);
    sm[r] = {m[r], (acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3])};
  }
}

// A block's rows, four at a time, then one at a time.
template <class VF>
[[gnu::always_inline]] inline void softmax_rows_impl(RowSoftmax* sm, float* s, int64_t ld,
                                                     int64_t M, int64_t n0, int64_t nk,
                                                     float scale) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) {
    const int64_t n[4] = {n0 + r, n0 + r + 1, n0 + r + 2, n0 + r + 3};
    softmax_group<VF, 4>(sm + r, s + r * ld, ld, n, nk, scale);
  }
  for (; r < M; ++r) {
    const int64_t n[1] = {n0 + r};
    softmax_group<VF, 1>(sm + r, s + r * ld, ld, n, nk, scale);
  }
}

// p = exp(s·scale − L), ds = p · (dp − D) over one vector; L and D one float for the vector (a
// query row's) or a vector of their own (a key row's columns, one query each).
template <class VF, class LD>
[[gnu::always_inline]] inline void p_ds_vector(float* s, float* dp, float scale, const LD& L,
                                               const LD& D) {
  VF x, d;
  load_v(x, s);
  load_v(d, dp);
  x = x * scale - L;
  exp_v(x, x);
  store_v(s, x);
  store_v(dp, x * (d - D));
}

template <class VF>
[[gnu::always_inline]] inline void p_ds_row_impl(float* s, float* dp, int64_t n, float scale,
                                                 float L, float D) {
  constexpr int64_t kW = sizeof(VF) / sizeof(float);
  const int64_t nr = round_up(n, 8);
  int64_t j = 0;
  for (; j + kW <= nr; j += kW) p_ds_vector<VF>(s + j, dp + j, scale, L, D);
  for (; j < nr; j += 8) p_ds_vector<VF8>(s + j, dp + j, scale, L, D);
}

MOETRAIN_ROWS_HOT void softmax_rows_narrow(RowSoftmax* sm, float* s, int64_t ld, int64_t M,
                                           int64_t n0, int64_t nk, float scale) {
  softmax_rows_impl<VF8>(sm, s, ld, M, n0, nk, scale);
}
MOETRAIN_ROWS_HOT void p_ds_row_narrow(float* s, float* dp, int64_t n, float scale, float L,
                                       float D) {
  p_ds_row_impl<VF8>(s, dp, n, scale, L, D);
}
#ifdef MOETRAIN_ROWS_WIDE
MOETRAIN_ROWS_AVX512 void softmax_rows_wide(RowSoftmax* sm, float* s, int64_t ld, int64_t M,
                                            int64_t n0, int64_t nk, float scale) {
  softmax_rows_impl<VF16>(sm, s, ld, M, n0, nk, scale);
}
MOETRAIN_ROWS_AVX512 void p_ds_row_wide(float* s, float* dp, int64_t n, float scale, float L,
                                        float D) {
  p_ds_row_impl<VF16>(s, dp, n, scale, L, D);
}
#endif

}  // namespace

void attention_softmax_rows([[maybe_unused]] bool wide, RowSoftmax* sm, float* s, int64_t ld,
                            int64_t M, int64_t n0, int64_t nk, float scale) {
#ifdef MOETRAIN_ROWS_WIDE
  if (wide && cpu_has_avx512f()) return softmax_rows_wide(sm, s, ld, M, n0, nk, scale);
#endif
  softmax_rows_narrow(sm, s, ld, M, n0, nk, scale);
}

void attention_p_ds_row([[maybe_unused]] bool wide, float* s, float* dp, int64_t n, float scale,
                        float L, float D) {
#ifdef MOETRAIN_ROWS_WIDE
  if (wide && cpu_has_avx512f()) return p_ds_row_wide(s, dp, n, scale, L, D);
#endif
  p_ds_row_narrow(s, dp, n, scale, L, D);
}

void softmax_rows(RowSoftmax* sm, float* s, int64_t ld, int64_t M, int64_t n0, int64_t nk,
                  float scale) {
  attention_softmax_rows(true, sm, s, ld, M, n0, nk, scale);
}

void p_ds_row(float* s, float* dp, int64_t n, float scale, float L, float D) {
  attention_p_ds_row(true, s, dp, n, scale, L, D);
}

// p_ds_cols: eight columns at a time, L and D read with them; the last partial vector on padded
// copies (L and D are readable over n only).
MOETRAIN_ROWS_HOT void p_ds_cols(float* p, float* ds, const float* L, const float* D, int64_t n,
                                 float scale) {
  const auto step = [scale](float* pp, float* dd, const float* LL, const float* DD) {
    VF8 l, d;
    load_v(l, LL);
    load_v(d, DD);
    p_ds_vector<VF8>(pp, dd, scale, l, d);
  };
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) step(p + c, ds + c, L + c, D + c);
  if (c == n) return;
  const std::size_t tail = static_cast<std::size_t>(n - c) * sizeof(float);
  float pb[8] = {}, db[8] = {}, lb[8] = {}, dd[8] = {};
  std::memcpy(pb, p + c, tail);
  std::memcpy(db, ds + c, tail);
  std::memcpy(lb, L + c, tail);
  std::memcpy(dd, D + c, tail);
  step(pb, db, lb, dd);
  std::memcpy(p + c, pb, tail);
  std::memcpy(ds + c, db, tail);
}

MOETRAIN_ROWS_HOT void block_lse(float* lse, float* inv_l, const RowSoftmax* sm, int64_t M) {
  for (int64_t r = 0; r < M; r += 4) {
    const int64_t n = std::min<int64_t>(4, M - r);
    VD4 l = VD4{} + 1.0, y;
    for (int64_t k = 0; k < n; ++k) l[k] = sm[r + k].l;
    log_vd4(y, l);
    for (int64_t k = 0; k < n; ++k) {
      const double lg = std::isnan(y[k]) ? std::log(l[k]) : y[k];  // l not a normal positive
      lse[r + k] = sm[r + k].m + static_cast<float>(lg);
      inv_l[r + k] = static_cast<float>(1.0 / l[k]);
    }
  }
}

void attention_row_terms(float* D, const float* dout, const float* out, int64_t B, int64_t T,
                         int64_t NH, int64_t HS) {
  // dP·P summed over a row equals dout·out, which spares recomputing the whole row first.
#pragma omp parallel for collapse(2) schedule(static) if (B * T * NH * HS >= kParallelMinCopy)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < NH; ++h) {
        const float* x = dout + ((b * T + t) * NH + h) * HS;
        const float* y = out + ((b * T + t) * NH + h) * HS;
        const double sum = lane_sum8(HS, [x, y](int64_t i) { return double(x[i]) * y[i]; });
        D[(b * NH + h) * T + t] = static_cast<float>(sum);
      }
    }
  }
}

void* attention_scratch(int slot, int64_t n) {
  MOETRAIN_CHECK(slot >= 0 && slot < 16, "attention_scratch: slot {} of 16", slot);
  thread_local GrowBuffer<4> buffers[16];
  return buffers[slot].grow(n);
}

void write_kv_gradients(float* dk, float* dv, const float* dk_acc, const float* dv_acc, int64_t b,
                        int64_t g, int64_t T, int64_t NKV, int64_t HS, int64_t HSp, float scale) {
  for (int64_t t = 0; t < T; ++t) {
    float* dkd = dk + ((b * T + t) * NKV + g) * HS;
    float* dvd = dv + ((b * T + t) * NKV + g) * HS;
    for (int64_t x = 0; x < HS; ++x) {
      dkd[x] = dk_acc[t * HSp + x] * scale;
      dvd[x] = dv_acc[t * HSp + x];
    }
  }
}

}  // namespace moetrain
