#include "kernels/attention.h"
#include "kernels/attention_rows.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/buffer.h"
#include "core/check.h"
#include "core/profile.h"
#include "core/threads.h"
#include "kernels/tile_gemm.h"

namespace moetrain {

namespace {

// Rows (queries in the forward and dq passes, keys in the dk/dv pass) owned by one task.
// A multiple of kNR (tile_gemm's columns), so a block's column window inside a transposed pack
// never runs past Tp.
constexpr int64_t kBlock = 32;
constexpr int64_t kNR = kTileCols;
// Longest (padded) sequence whose backward runs in one pass: two (Tp, Tp) buffers a thread.
constexpr int64_t kOnePassMaxT = 512;

// Below this size a parallel region costs more than it saves (copies: kParallelMinCopy,
// attention_rows.h); thread count never changes results, so the cut-off is free to move.
constexpr int64_t kParallelMinWork = 1 << 20;  // multiply-adds, roughly

// One head's (T, HS) rows as tile_gemm's B operand: readable over HSp = round_up(HS, kNR) columns.
struct Rows {
  const float* p;
  int64_t ld;
};

// Where HS is not a multiple of kNR, heads are copied into (B, H, T, HSp) with zero columns on the
// right; otherwise the source is used in place.
class RowsPack {
 public:
  RowsPack(const float* src, int64_t B, int64_t T, int64_t H, int64_t HS, int64_t HSp)
      : src_(src), T_(T), H_(H), HS_(HS), HSp_(HSp) {
    if (HS == HSp) return;
    pack_.assign(B * H * T * HSp, 0.0f);
#pragma omp parallel for collapse(2) schedule(static) if (B * T * H * HS >= kParallelMinCopy)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < H; ++h) {
          std::copy_n(src + ((b * T + t) * H + h) * HS, HS,
                      pack_.data() + ((b * H + h) * T + t) * HSp);
        }
      }
    }
  }
  // Head h of batch b from row t on.
  Rows at(int64_t b, int64_t h, int64_t t) const {
    if (pack_.empty()) return {src_ + ((b * T_ + t) * H_ + h) * HS_, H_ * HS_};
    return {pack_.data() + ((b * H_ + h) * T_ + t) * HSp_, HSp_};
  }

 private:
  const float* src_;
  int64_t T_, H_, HS_, HSp_;
  std::vector<float> pack_;
};

}  // namespace

void attention_check_args(const char* fn, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                          int64_t HS) {
  MOETRAIN_CHECK(B >= 0 && T >= 0, "{}: batch B={} and sequence length T={} must be >= 0", fn, B,
                 T);
  MOETRAIN_CHECK(NH > 0 && NKV > 0, "{}: head counts must be positive, got NH={} NKV={}", fn, NH,
                 NKV);
  MOETRAIN_CHECK(NH % NKV == 0,
                 "{}: NH={} query heads must be a multiple of NKV={} key/value heads", fn, NH, NKV);
  MOETRAIN_CHECK(HS > 0, "{}: head size HS={} must be positive", fn, HS);
}

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  PhaseScope phase_scope(Phase::Attention);
  attention_check_args("attention_forward", B, T, NH, NKV, HS);
  if (B == 0 || T == 0) return;
  MOETRAIN_CHECK(out && lse && q && k && v, "attention_forward: null buffer for B={} T={}", B, T);
  const int64_t G = NH / NKV, Tp = round_up(T, kBlock), HSp = round_up(HS, kNR), nqb = Tp / kBlock;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));

  float* kt = attention_scratch_as<float>(0, B * NKV * HS * Tp);  // (B, NKV, HS, Tp)
  pack_transposed(kt, k, B, T, NKV, HS, Tp);
  const RowsPack vrows(v, B, T, NKV, HS, HSp);

  const int64_t tasks = B * NH * nqb;
#pragma omp parallel if (B * NH * T * T * HS >= kParallelMinWork)
  {
    std::vector<float> s(kBlock * Tp);   // scores, then unnormalised probabilities
    std::vector<float> o(kBlock * HSp);  // unnormalised outputs
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task) {
      // Late query blocks see the most keys; handing them out first evens the load.
      const int64_t qb = nqb - 1 - task % nqb, b = task / nqb / NH, h = task / nqb % NH, g = h / G;
      const int64_t i0 = qb * kBlock, M = std::min(kBlock, T - i0), nk = i0 + M;
      const int64_t qrow = (b * T + i0) * NH + h;
      tile_gemm(s.data(), Tp, q + qrow * HS, NH * HS, kt + (b * NKV + g) * HS * Tp, Tp, M,
                round_up(nk, kNR), HS, false, false, {TileCausal::Columns, i0});
      float inv_l[kBlock];
      RowSoftmax sm[kBlock];
      softmax_rows(sm, s.data(), Tp, M, i0 + 1, nk, scale);  // query i0 + r sees i0 + r + 1 keys
      block_lse(lse + (b * NH + h) * T + i0, inv_l, sm, M);
      const Rows vb = vrows.at(b, g, 0);
      tile_gemm(o.data(), HSp, s.data(), Tp, vb.p, vb.ld, M, HSp, nk, false, false,
                {TileCausal::TermsTo, i0});
      for (int64_t r = 0; r < M; ++r) {
        float* dst = out + (qrow + r * NH) * HS;
        for (int64_t x = 0; x < HS; ++x) dst[x] = o[r * HSp + x] * inv_l[r];
      }
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  PhaseScope phase_scope(Phase::Attention);
  attention_check_args("attention_backward", B, T, NH, NKV, HS);
  if (B == 0 || T == 0) return;
  MOETRAIN_CHECK(dq && dk && dv && dout && q && k && v && out && lse,
                 "attention_backward: null buffer for B={} T={}", B, T);
  const int64_t G = NH / NKV, Tp = round_up(T, kBlock), HSp = round_up(HS, kNR), nb = Tp / kBlock;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));

  float* D = attention_scratch_as<float>(0, B * NH * T);  // (B, NH, T)
  attention_row_terms(D, dout, out, B, T, NH, HS);

  float* kt = attention_scratch_as<float>(1, B * NKV * HS * Tp);  // (B, NKV, HS, Tp)
  float* vt = attention_scratch_as<float>(2, B * NKV * HS * Tp);
  pack_transposed(kt, k, B, T, NKV, HS, Tp);
  pack_transposed(vt, v, B, T, NKV, HS, Tp);
  const RowsPack krows(k, B, T, NKV, HS, HSp), qrows(q, B, T, NH, HS, HSp),
      dorows(dout, B, T, NH, HS, HSp);
  const bool parallel = B * NH * T * T * HS >= kParallelMinWork;

  // One pass, where a head's (T, T) probabilities and their gradient fit a task's buffers and
  // the (batch, kv head) tasks keep every thread busy: P and dS are formed once, row by row as
  // the dq pass below forms dS, and read transposed for dk and dv. Each value and each sum is
  // the two passes' (the same products in the same order), so the results are the same bits;
  // the two passes form every score twice and their exponentials twice.
  if (Tp <= kOnePassMaxT && B * NKV >= 2 * static_cast<int64_t>(num_threads())) {
    const int64_t tasks = B * NKV;
#pragma omp parallel if (parallel)
    {
      float* pm = attention_scratch_as<float>(5, Tp * Tp);   // P, then read transposed
      float* dsm = attention_scratch_as<float>(6, Tp * Tp);  // dP, then dS
      float* acc = attention_scratch_as<float>(7, kBlock * HSp);
      float* dk_acc = attention_scratch_as<float>(8, Tp * HSp);
      float* dv_acc = attention_scratch_as<float>(9, Tp * HSp);
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t b = task / NKV, g = task % NKV;
        std::fill(dk_acc, dk_acc + Tp * HSp, 0.0f);
        std::fill(dv_acc, dv_acc + Tp * HSp, 0.0f);
        const Rows kb = krows.at(b, g, 0);
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          for (int64_t qb = 0; qb < nb; ++qb) {
            const int64_t i0 = qb * kBlock, M = std::min(kBlock, T - i0), nk = i0 + M,
                          N = round_up(nk, kNR);
            const int64_t qrow = (b * T + i0) * NH + h;
            float* s = pm + i0 * Tp;
            float* ds = dsm + i0 * Tp;
            tile_gemm(s, Tp, q + qrow * HS, NH * HS, kt + (b * NKV + g) * HS * Tp, Tp, M, N, HS,
                      false, false, {TileCausal::Columns, i0});
            tile_gemm(ds, Tp, dout + qrow * HS, NH * HS, vt + (b * NKV + g) * HS * Tp, Tp, M, N, HS,
                      false, false, {TileCausal::Columns, i0});
            for (int64_t r = 0; r < M; ++r) {
              const int64_t i = i0 + r;
              p_ds_row(s + r * Tp, ds + r * Tp, i + 1, scale, lse[(b * NH + h) * T + i],
                       D[(b * NH + h) * T + i]);
              std::fill(s + r * Tp + i + 1, s + r * Tp + nk, 0.0f);
              std::fill(ds + r * Tp + i + 1, ds + r * Tp + nk, 0.0f);
            }
            tile_gemm(acc, HSp, ds, Tp, kb.p, kb.ld, M, HSp, nk, false, false,
                      {TileCausal::TermsTo, i0});
            for (int64_t r = 0; r < M; ++r) {
              float* dst = dq + (qrow + r * NH) * HS;
              for (int64_t x = 0; x < HS; ++x) dst[x] = acc[r * HSp + x] * scale;
            }
          }
          // Key block j0 sums over the queries at or after it: column j0 + r of P and dS from
          // row j0 on, read transposed (rows past a query's block end were never formed, and
          // no key of this block lies past it).
          for (int64_t j0 = 0; j0 < T; j0 += kBlock) {
            const int64_t M = std::min(kBlock, T - j0), nq = T - j0;
            const Rows dor = dorows.at(b, h, j0), qr = qrows.at(b, h, j0);
            tile_gemm(dv_acc + j0 * HSp, HSp, pm + j0 * Tp + j0, Tp, dor.p, dor.ld, M, HSp, nq,
                      true, true, {TileCausal::TermsFrom, 0});
            tile_gemm(dk_acc + j0 * HSp, HSp, dsm + j0 * Tp + j0, Tp, qr.p, qr.ld, M, HSp, nq, true,
                      true, {TileCausal::TermsFrom, 0});
          }
        }
        write_kv_gradients(dk, dv, dk_acc, dv_acc, b, g, T, NKV, HS, HSp, scale);
      }
    }
    return;
  }

  float* qt = attention_scratch_as<float>(3, B * NH * HS * Tp);  // (B, NH, HS, Tp)
  float* dot = attention_scratch_as<float>(4, B * NH * HS * Tp);
  pack_transposed(qt, q, B, T, NH, HS, Tp);
  pack_transposed(dot, dout, B, T, NH, HS, Tp);

  // dq: each task owns a block of queries of one head and sums over the keys it sees.
  const int64_t q_tasks = B * NH * nb;
#pragma omp parallel if (parallel)
  {
    std::vector<float> s(kBlock * Tp), dp(kBlock * Tp), acc(kBlock * HSp);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < q_tasks; ++task) {
      const int64_t qb = nb - 1 - task % nb, b = task / nb / NH, h = task / nb % NH, g = h / G;
      const int64_t i0 = qb * kBlock, M = std::min(kBlock, T - i0), nk = i0 + M,
                    N = round_up(nk, kNR);
      const int64_t qrow = (b * T + i0) * NH + h;
      tile_gemm(s.data(), Tp, q + qrow * HS, NH * HS, kt + (b * NKV + g) * HS * Tp, Tp, M, N, HS,
                false, false, {TileCausal::Columns, i0});
      tile_gemm(dp.data(), Tp, dout + qrow * HS, NH * HS, vt + (b * NKV + g) * HS * Tp, Tp, M, N,
                HS, false, false, {TileCausal::Columns, i0});
      for (int64_t r = 0; r < M; ++r) {
        float* srow = s.data() + r * Tp;
        float* dprow = dp.data() + r * Tp;
        const int64_t i = i0 + r;
        const float L = lse[(b * NH + h) * T + i], Di = D[(b * NH + h) * T + i];
        p_ds_row(srow, dprow, i + 1, scale, L, Di);
        std::fill(dprow + i + 1, dprow + nk, 0.0f);
      }
      const Rows kb = krows.at(b, g, 0);
      tile_gemm(acc.data(), HSp, dp.data(), Tp, kb.p, kb.ld, M, HSp, nk, false, false,
                {TileCausal::TermsTo, i0});
      for (int64_t r = 0; r < M; ++r) {
        float* dst = dq + (qrow + r * NH) * HS;
        for (int64_t x = 0; x < HS; ++x) dst[x] = acc[r * HSp + x] * scale;
      }
    }
  }

  // dk, dv: each task owns a block of keys of one kv head and sums over the query heads of its
  // group, then over the queries at or after each key, always in that order.
  const int64_t kv_tasks = B * NKV * nb;
#pragma omp parallel if (parallel)
  {
    std::vector<float> p(kBlock * Tp), ds(kBlock * Tp), dk_acc(kBlock * HSp), dv_acc(kBlock * HSp);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < kv_tasks; ++task) {
      // Early key blocks are seen by the most queries; hand them out first.
      const int64_t kb = task % nb, b = task / nb / NKV, g = task / nb % NKV;
      const int64_t j0 = kb * kBlock, M = std::min(kBlock, T - j0), nq = T - j0,
                    N = round_up(nq, kNR);
      const int64_t krow = (b * T + j0) * NKV + g;
      std::fill(dk_acc.begin(), dk_acc.end(), 0.0f);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.0f);
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        // Column c of these (keys × queries) tiles is query j0 + c.
        tile_gemm(p.data(), Tp, k + krow * HS, NKV * HS, qt + (b * NH + h) * HS * Tp + j0, Tp, M, N,
                  HS, false);
        tile_gemm(ds.data(), Tp, v + krow * HS, NKV * HS, dot + (b * NH + h) * HS * Tp + j0, Tp, M,
                  N, HS, false);
        const float* L = lse + (b * NH + h) * T + j0;
        const float* Dh = D + (b * NH + h) * T + j0;
        for (int64_t r = 0; r < M; ++r) {
          float* prow = p.data() + r * Tp;
          float* dsrow = ds.data() + r * Tp;
          std::fill(prow, prow + r, 0.0f);
          std::fill(dsrow, dsrow + r, 0.0f);
          p_ds_cols(prow + r, dsrow + r, L + r, Dh + r, nq - r, scale);
        }
        const Rows dor = dorows.at(b, h, j0), qr = qrows.at(b, h, j0);
        tile_gemm(dv_acc.data(), HSp, p.data(), Tp, dor.p, dor.ld, M, HSp, nq, true, false,
                  {TileCausal::TermsFrom, 0});
        tile_gemm(dk_acc.data(), HSp, ds.data(), Tp, qr.p, qr.ld, M, HSp, nq, true, false,
                  {TileCausal::TermsFrom, 0});
      }
      for (int64_t r = 0; r < M; ++r) {
        float* dkd = dk + (krow + r * NKV) * HS;
        float* dvd = dv + (krow + r * NKV) * HS;
        for (int64_t x = 0; x < HS; ++x) {
          dkd[x] = dk_acc[r * HSp + x] * scale;
          dvd[x] = dv_acc[r * HSp + x];
        }
      }
    }
  }
}

void attention_decode(float* out, const float* q, const float* k, const float* v, int64_t n,
                      int64_t NH, int64_t NKV, int64_t HS) {
  MOETRAIN_CHECK(n > 0 && NH > 0 && NKV > 0 && NH % NKV == 0 && HS > 0,
                 "attention_decode: n={} NH={} NKV={} HS={}: need n, HS > 0 and NH % NKV == 0", n,
                 NH, NKV, HS);
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const int64_t group = NH / NKV, KD = NKV * HS;
  // One token's work is small (n·HS per head): a parallel region would cost more than it saves.
  std::vector<float> p(static_cast<std::size_t>(n));
  for (int64_t h = 0; h < NH; ++h) {
    const float* qh = q + h * HS;
    const int64_t kv = (h / group) * HS;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = k + j * KD + kv;
      float s = 0.0f;
      for (int64_t x = 0; x < HS; ++x) s += qh[x] * kj[x];
      p[j] = s * scale;
      mx = std::max(mx, p[j]);
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += p[j] = std::exp(p[j] - mx);
    float* oh = out + h * HS;
    std::fill(oh, oh + HS, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const float w = p[j] / sum;
      const float* vj = v + j * KD + kv;
      for (int64_t x = 0; x < HS; ++x) oh[x] += w * vj[x];
    }
  }
}

}  // namespace moetrain
