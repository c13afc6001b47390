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

// The softmax's exponentials go through exp_v (kernels/vec_math.h, within 1 ulp of exp), VF's
// lanes at a time, then eight for the last columns of a row whose length is not a multiple of
// the width. Lanes are independent, so a score's result does not depend on where its row ends or
// on the width: a row's last partial vector reads scores tile_gemm has written past the row's end
// (and its results there are overwritten), or padded copies where the data itself ends.

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

// The row in two passes, VF vectors and then VF8 ones over round_up(n, 8) columns: scaled, with
// the largest scaled score over [0, n) taken as they go (a maximum is the same whatever the
// order: row_max's, NaNs passed over, and a zero maximum taken again in order for its sign); then
// exp(x − m), lanes past n zeroed, stored and summed in double in the order of four lanes of two
// halves, then the lanes in order.
template <class VF>
[[gnu::always_inline]] inline RowSoftmax softmax_row_impl(float* row, int64_t n, int64_t nk,
                                                          float scale) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t nr = round_up(n, 8);
  // f(x, j) on the vector at column j: VF's width while it fits, then 8 lanes.
  const auto each_vector = [row, nr](auto f) {
    constexpr int64_t kW = sizeof(VF) / sizeof(float);
    int64_t j = 0;
    for (; j + kW <= nr; j += kW) {
      VF x;
      load_v(x, row + j);
      f(x, j);
      store_v(row + j, x);
    }
    for (; j < nr; j += 8) {
      VF8 x;
      load_v(x, row + j);
      f(x, j);
      store_v(row + j, x);
    }
  };
  VF mw = VF{} - kInf;
  VF8 m8 = VF8{} - kInf;
  each_vector([n, scale, &mw, &m8](auto& x, int64_t j) {
    x = x * scale;
    auto y = x;
    keep_lanes(y, n - j, -kInf);
    if constexpr (sizeof(y) == sizeof(VF8) && sizeof(VF) != sizeof(VF8))
      m8 = m8 < y ? y : m8;
    else
      mw = mw < y ? y : mw;
  });
  float m = -kInf;
  for (std::size_t k = 0; k < sizeof(VF) / sizeof(float); ++k) m = std::max(m, mw[k]);
  for (int k = 0; k < 8; ++k) m = std::max(m, m8[k]);
  if (m == 0.0f) m = row_max(row, n);
  VD4 acc = VD4{};
  each_vector([n, m, &acc](auto& x, int64_t j) {
    x -= m;
    exp_v(x, x);
    keep_lanes(x, n - j, 0.0f);
    add_quarters(acc, x);
  });
  if (nk > nr) std::fill(row + nr, row + nk, 0.0f);
  return {m, (acc[0] + acc[1]) + (acc[2] + acc[3])};
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

MOETRAIN_ROWS_HOT RowSoftmax softmax_row_narrow(float* row, int64_t n, int64_t nk, float scale) {
  return softmax_row_impl<VF8>(row, n, nk, scale);
}
MOETRAIN_ROWS_HOT void p_ds_row_narrow(float* s, float* dp, int64_t n, float scale, float L,
                                       float D) {
  p_ds_row_impl<VF8>(s, dp, n, scale, L, D);
}
#ifdef MOETRAIN_ROWS_WIDE
MOETRAIN_ROWS_AVX512 RowSoftmax softmax_row_wide(float* row, int64_t n, int64_t nk, float scale) {
  return softmax_row_impl<VF16>(row, n, nk, scale);
}
MOETRAIN_ROWS_AVX512 void p_ds_row_wide(float* s, float* dp, int64_t n, float scale, float L,
                                        float D) {
  p_ds_row_impl<VF16>(s, dp, n, scale, L, D);
}
#endif

}  // namespace

RowSoftmax attention_softmax_row([[maybe_unused]] bool wide, float* row, int64_t n, int64_t nk,
                                 float scale) {
#ifdef MOETRAIN_ROWS_WIDE
  if (wide && cpu_has_avx512f()) return softmax_row_wide(row, n, nk, scale);
#endif
  return softmax_row_narrow(row, n, nk, scale);
}

void attention_p_ds_row([[maybe_unused]] bool wide, float* s, float* dp, int64_t n, float scale,
                        float L, float D) {
#ifdef MOETRAIN_ROWS_WIDE
  if (wide && cpu_has_avx512f()) return p_ds_row_wide(s, dp, n, scale, L, D);
#endif
  p_ds_row_narrow(s, dp, n, scale, L, D);
}

RowSoftmax softmax_row(float* row, int64_t n, int64_t nk, float scale) {
  return attention_softmax_row(true, row, n, nk, scale);
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
