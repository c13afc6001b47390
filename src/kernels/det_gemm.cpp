#include "kernels/det_gemm.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/buffer.h"
#include "core/check.h"
#include "core/profile.h"
#include "kernels/tile_gemm.h"

namespace moetrain {

namespace {

// Reduction rows per task of a weight-gradient GEMM; a longer reduction is split and summed.
constexpr int64_t kReduceChunk = 2048;

// Cuts n rows into ceil(n / block) near-equal pieces and appends them to `out`.
void split_rows(std::vector<RowBlock>& out, int64_t group, int64_t row0, int64_t n, int64_t block) {
  const int64_t pieces = (n + block - 1) / block;
  for (int64_t i = 0; i < pieces; ++i) {
    int64_t b = n * i / pieces, e = n * (i + 1) / pieces;
    out.push_back({group, row0 + b, e - b});
  }
}

void check_counts(const int64_t* M, int64_t G, const char* what) {
  MOETRAIN_CHECK(G >= 0, "{}: negative group count {}", what, G);
  for (int64_t g = 0; g < G; ++g) {
    MOETRAIN_CHECK(M[g] >= 0, "{}: group {} has negative row count {}", what, g, M[g]);
  }
}

inline float to_f(float x) {
  return x;
}
inline float to_f(bf16 x) {
  return x.to_float();
}
inline float to_f(fp16 x) {
  return x.to_float();
}

// f32 products with a side narrower than one tile of columns (a router's E logits a token, their
// gradient's E terms, the gate's E rows of weight gradient): oneDNN runs these at a tenth of its
// rate or less, so the attention's tile kernel takes them. Each element is then one sequential
// sum over k, on every CPU path and for every row count (tile_gemm.h).
bool narrow(int64_t n) {
  return n < kTileCols;
}

// tile_gemm writes round_up(M, kTileRows) rows of C: the rows past M go through a scratch tile.
void tile_rows(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
               int64_t M, int64_t N, int64_t K, bool accumulate, bool trans_a) {
  const int64_t whole = M / kTileRows * kTileRows, rest = M - whole;
  if (whole > 0) tile_gemm(C, ldc, A, lda, B, ldb, whole, N, K, accumulate, trans_a);
  if (rest == 0) return;
  thread_local std::vector<float> tail;
  tail.resize(static_cast<std::size_t>(kTileRows * N));
  if (accumulate) {
    for (int64_t m = 0; m < rest; ++m) std::copy_n(C + (whole + m) * ldc, N, tail.data() + m * N);
  }
  const float* a = trans_a ? A + whole : A + whole * lda;
  tile_gemm(tail.data(), N, a, lda, B, ldb, rest, N, K, accumulate, trans_a);
  for (int64_t m = 0; m < rest; ++m) std::copy_n(tail.data() + m * N, N, C + (whole + m) * ldc);
}

// C (M, N) = A (M, K) · op(B) [+ C] with N or K narrow: B as (K, N) rows padded with zero
// columns to a multiple of kTileCols, C through a scratch of that width where N is not one.
void narrow_task_gemm(Trans tb, int64_t M, int64_t N, int64_t K, const float* A, const float* B,
                      float* C, bool accumulate) {
  const int64_t W = (N + kTileCols - 1) / kTileCols * kTileCols;
  thread_local std::vector<float> bp, cp;
  const float* bw = B;  // B as (K, W) rows
  if (tb == Trans::T || W != N) {
    bp.assign(static_cast<std::size_t>(K * W), 0.0f);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) bp[k * W + n] = tb == Trans::T ? B[n * K + k] : B[k * N + n];
    bw = bp.data();
  }
  if (W == N) return tile_rows(C, N, A, K, bw, W, M, N, K, accumulate, false);
  cp.resize(static_cast<std::size_t>(M * W));
  if (accumulate) {
    for (int64_t m = 0; m < M; ++m) std::copy_n(C + m * N, N, cp.data() + m * W);
  }
  tile_rows(cp.data(), W, A, K, bw, W, M, W, K, accumulate, false);
  for (int64_t m = 0; m < M; ++m) std::copy_n(cp.data() + m * W, N, C + m * N);
}

}  // namespace

template <class T>
void task_gemm(Trans tb, int64_t M, int64_t N, int64_t K, const T* A, const T* B, float* C,
               bool accumulate) {
  if constexpr (std::is_same_v<T, float>) {
    if ((narrow(N) || narrow(K)) && !is_small_gemm(M, N, K))
      return narrow_task_gemm(tb, M, N, K, A, B, C, accumulate);
  }
  if (!is_small_gemm(M, N, K)) {
    grouped_gemm(tb, 1, &M, N, K, A, B, 0, C, accumulate);
    return;
  }
  for (int64_t m = 0; m < M; ++m) {
    const T* a = A + m * K;
    float* c = C + m * N;
    if (tb == Trans::T) {
      for (int64_t n = 0; n < N; ++n) {
        float s = 0.0f;
        for (int64_t k = 0; k < K; ++k) s += to_f(a[k]) * to_f(B[n * K + k]);
        c[n] = accumulate ? c[n] + s : s;
      }
    } else {
      if (!accumulate) std::memset(c, 0, sizeof(float) * N);
      for (int64_t k = 0; k < K; ++k) {
        const T* b = B + k * N;
        const float ak = to_f(a[k]);
        for (int64_t n = 0; n < N; ++n) c[n] += ak * to_f(b[n]);
      }
    }
  }
}

template <class T>
void task_gemm_reduce(int64_t M, int64_t P, int64_t Q, const T* A, const T* B, float* C,
                      bool accumulate) {
  if constexpr (std::is_same_v<T, float>) {
    // Aᵀ is the tile kernel's transposed A; Q a whole number of its column tiles.
    if (narrow(P) && Q % kTileCols == 0 && !is_small_gemm(M, P, Q))
      return tile_rows(C, Q, A, P, B, Q, P, Q, M, accumulate, true);
  }
  if (!is_small_gemm(M, P, Q)) {
    grouped_gemm_reduce(1, &M, P, Q, A, B, C, 0, accumulate);
    return;
  }
  if (!accumulate) std::memset(C, 0, sizeof(float) * P * Q);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t p = 0; p < P; ++p) {
      const float a = to_f(A[m * P + p]);
      for (int64_t q = 0; q < Q; ++q) C[p * Q + q] += a * to_f(B[m * Q + q]);
    }
  }
}

template void task_gemm(Trans, int64_t, int64_t, int64_t, const float*, const float*, float*, bool);
template void task_gemm(Trans, int64_t, int64_t, int64_t, const bf16*, const bf16*, float*, bool);
template void task_gemm(Trans, int64_t, int64_t, int64_t, const fp16*, const fp16*, float*, bool);
template void task_gemm_reduce(int64_t, int64_t, int64_t, const float*, const float*, float*, bool);
template void task_gemm_reduce(int64_t, int64_t, int64_t, const bf16*, const bf16*, float*, bool);
template void task_gemm_reduce(int64_t, int64_t, int64_t, const fp16*, const fp16*, float*, bool);

namespace {
// One reduce task on the problem's operand type.
void reduce_task(const ReduceProblem& pr, const RowBlock& rows, float* out, bool accumulate) {
  const int64_t es = static_cast<int64_t>(dtype_size(pr.dtype));
  const char* a = static_cast<const char*>(pr.A) + rows.row0 * pr.P * es;
  const char* b = static_cast<const char*>(pr.B) + rows.row0 * pr.Q * es;
  switch (pr.dtype) {
    case DType::F32:
      return task_gemm_reduce(rows.rows, pr.P, pr.Q, reinterpret_cast<const float*>(a),
                              reinterpret_cast<const float*>(b), out, accumulate);
    case DType::BF16:
      return task_gemm_reduce(rows.rows, pr.P, pr.Q, reinterpret_cast<const bf16*>(a),
                              reinterpret_cast<const bf16*>(b), out, accumulate);
    case DType::F16:
      return task_gemm_reduce(rows.rows, pr.P, pr.Q, reinterpret_cast<const fp16*>(a),
                              reinterpret_cast<const fp16*>(b), out, accumulate);
  }
}
}  // namespace

std::vector<RowBlock> row_blocks(const int64_t* M, int64_t G) {
  check_counts(M, G, "row_blocks");
  std::vector<RowBlock> blocks;
  int64_t row = 0;
  for (int64_t g = 0; g < G; ++g) {
    split_rows(blocks, g, row, M[g], kRowBlock);
    row += M[g];
  }
  return blocks;
}

void largest_first(std::vector<RowBlock>& blocks) {
  std::stable_sort(blocks.begin(), blocks.end(),
                   [](const RowBlock& x, const RowBlock& y) { return x.rows > y.rows; });
}

void grouped_gemm_det(Trans tb, int64_t G, const int64_t* M, int64_t N, int64_t K, const float* A,
                      const float* B, int64_t b_stride, float* C, bool accumulate) {
  MOETRAIN_CHECK(N >= 0 && K >= 0, "grouped_gemm_det: negative size N={} K={}", N, K);
  const std::vector<RowBlock> blocks = row_blocks(M, G);
  const int64_t n = static_cast<int64_t>(blocks.size());
  const int64_t R = n == 0 ? 0 : blocks.back().row0 + blocks.back().rows;
#pragma omp parallel for schedule(dynamic, 1) if (!is_small_gemm(R, N, K))
  for (int64_t i = 0; i < n; ++i) {
    const RowBlock& t = blocks[i];
    task_gemm(tb, t.rows, N, K, A + t.row0 * K, B + t.group * b_stride, C + t.row0 * N, accumulate);
  }
}

void grouped_gemm_reduce_det(int64_t G, const int64_t* M, const ReduceProblem* problems,
                             int64_t n_problems, bool accumulate) {
  PhaseScope phase_scope(Phase::ExpertWgrad);
  check_counts(M, G, "grouped_gemm_reduce_det");
  struct Task {
    int64_t problem;
    RowBlock rows;
    int64_t partial;  // -1: straight into C_g; else the offset of its scratch partial
  };
  // The first chunk of a group goes straight into C_g (with its accumulate); the others into
  // scratch partials that are added afterwards, in chunk order.
  std::vector<Task> tasks;
  std::vector<RowBlock> chunks;
  int64_t scratch_floats = 0, macs = 0;
  for (int64_t p = 0; p < n_problems; ++p) {
    const ReduceProblem& pr = problems[p];
    MOETRAIN_CHECK(pr.P >= 0 && pr.Q >= 0, "grouped_gemm_reduce_det: negative size P={} Q={}", pr.P,
                   pr.Q);
    macs += pr.P * pr.Q;
    int64_t row = 0;
    for (int64_t g = 0; g < G; ++g) {
      if (M[g] == 0 && !accumulate) {
        for (int64_t i = 0; i < pr.P; ++i)
          std::memset(pr.C + g * pr.c_stride + i * pr.Q, 0, sizeof(float) * pr.Q);
      }
      chunks.clear();
      split_rows(chunks, g, row, M[g], kReduceChunk);
      for (size_t c = 0; c < chunks.size(); ++c) {
        int64_t partial = -1;
        if (c > 0) {
          partial = scratch_floats;
          scratch_floats += pr.P * pr.Q;
        }
        tasks.push_back({p, chunks[c], partial});
      }
      row += M[g];
    }
  }
  thread_local FloatBuffer scratch;
  float* partials = scratch.ensure(scratch_floats);
  const int64_t n = static_cast<int64_t>(tasks.size());
  int64_t R = 0;
  for (int64_t g = 0; g < G; ++g) R += M[g];
  // Largest tasks first: the groups' row counts differ, and a large task handed out last leaves
  // the other threads idle while it runs. Each task writes its own output, so the order in which
  // tasks run does not change any result.
  std::vector<int64_t> order(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&tasks, problems](int64_t x, int64_t y) {
    auto work = [&](int64_t i) {
      return tasks[i].rows.rows * problems[tasks[i].problem].P * problems[tasks[i].problem].Q;
    };
    return work(x) > work(y);
  });
#pragma omp parallel for schedule(dynamic, 1) if (!is_small_gemm(R, macs, 1))
  for (int64_t i = 0; i < n; ++i) {
    const Task& t = tasks[order[i]];
    const ReduceProblem& pr = problems[t.problem];
    float* out = t.partial < 0 ? pr.C + t.rows.group * pr.c_stride : partials + t.partial;
    reduce_task(pr, t.rows, out, t.partial < 0 && accumulate);
  }
  if (scratch_floats == 0) return;
  // Partials of one (problem, group) follow its direct task in the list, in chunk order.
  for (int64_t i = 0; i < n;) {
    int64_t j = i + 1;
    while (j < n && tasks[j].partial >= 0) ++j;
    if (j > i + 1) {
      const ReduceProblem& pr = problems[tasks[i].problem];
      float* c = pr.C + tasks[i].rows.group * pr.c_stride;
      const int64_t PQ = pr.P * pr.Q;
#pragma omp parallel for schedule(static) if (PQ > 16384)
      for (int64_t e = 0; e < PQ; ++e) {
        float v = c[e];
        for (int64_t k = i + 1; k < j; ++k) v += partials[tasks[k].partial + e];
        c[e] = v;
      }
    }
    i = j;
  }
}

}  // namespace moetrain
