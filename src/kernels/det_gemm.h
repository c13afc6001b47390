// Grouped GEMMs whose results do not depend on the thread count.
//
// oneDNN's sgemm partitions rows by the number of threads and computes the rows left at the end
// of a partition with a different micro-kernel, so the same product can differ in the last bit
// between 1 and 2 threads. Here the work is cut into tasks whose shapes depend only on the
// problem (fixed row blocks, fixed reduction chunks), each task is single-threaded oneDNN
// (oneDNN runs sequentially inside an active OpenMP parallel region, so even a single task is
// run inside one), and the partial sums of a split reduction are added in chunk order. Same
// semantics as kernels/gemm.h.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/gemm.h"

namespace moetrain {

// Products below this many multiply-adds run as plain loops on the calling thread: a oneDNN call
// and a parallel region cost more than they do, and the result is thread-count invariant too.
constexpr int64_t kSmallGemmMacs = 1 << 15;
inline bool is_small_gemm(int64_t M, int64_t N, int64_t K) {
  return M * N * K < kSmallGemmMacs;
}

// One product of a task: C (M, N) = A (M, K) · op(B) (K, N) [+ C], all packed. Single-threaded
// (plain loops when small, else oneDNN, which must then be called inside a parallel region).
// T: float, bf16 or fp16 operands; f32 accumulation and output.
template <class T>
void task_gemm(Trans tb, int64_t M, int64_t N, int64_t K, const T* A, const T* B, float* C,
               bool accumulate);
// C (P, Q) = Aᵀ (P, M) · B (M, Q) [+ C], all packed. As task_gemm.
template <class T>
void task_gemm_reduce(int64_t M, int64_t P, int64_t Q, const T* A, const T* B, float* C,
                      bool accumulate);

// Rows [row0, row0 + rows) of the packed buffer, all in group `group`.
struct RowBlock {
  int64_t group, row0, rows;
};
// Each group's rows cut into near-equal blocks of at most kRowBlock rows, group after group.
// Large enough that a task amortises packing its weights (on an AVX2-only CPU a single-threaded
// sgemm of 256 rows runs 10-20% below one of thousands; 512 rows close most of that), small
// enough to balance a few groups over the cores.
constexpr int64_t kRowBlock = 512;
std::vector<RowBlock> row_blocks(const int64_t* M, int64_t G);
// The same blocks in the order a dynamic schedule should hand them out: most rows first, so the
// blocks left when the threads run out of work are the smallest. Blocks write disjoint rows, so
// the order changes no result.
void largest_first(std::vector<RowBlock>& blocks);

// C_g (M_g, N) = A_g (M_g, K) · op(B_g) (K, N) [+ C_g], B_g = B + g·b_stride; rows packed group
// after group, as grouped_gemm.
void grouped_gemm_det(Trans tb, int64_t G, const int64_t* M, int64_t N, int64_t K, const float* A,
                      const float* B, int64_t b_stride, float* C, bool accumulate);

// One weight-gradient product over the groups: C_g (P, Q) [+]= A_gᵀ (P, M_g) · B_g (M_g, Q),
// C_g = C + g·c_stride, A_g (M_g, P) and B_g (M_g, Q) packed group after group.
// A and B hold elements of `dtype` (mixed precision: bf16 or fp16 operands, f32 C).
struct ReduceProblem {
  int64_t P = 0, Q = 0;
  const void* A = nullptr;
  const void* B = nullptr;
  float* C = nullptr;
  int64_t c_stride = 0;
  DType dtype = DType::F32;
};
// Runs several problems that share the groups' row counts in one parallel pass. A group with
// M_g = 0 is left untouched when accumulating, zeroed otherwise (as grouped_gemm_reduce).
void grouped_gemm_reduce_det(int64_t G, const int64_t* M, const ReduceProblem* problems,
                             int64_t n_problems, bool accumulate);
inline void grouped_gemm_reduce_det(int64_t G, const int64_t* M, int64_t P, int64_t Q,
                                    const float* A, const float* B, float* C, int64_t c_stride,
                                    bool accumulate) {
  ReduceProblem p{P, Q, A, B, C, c_stride};
  grouped_gemm_reduce_det(G, M, &p, 1, accumulate);
}

}  // namespace moetrain
