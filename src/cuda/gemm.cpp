#include "cuda/gemm.h"

#include <cublasLt.h>

#include <array>
#include <atomic>
#include <map>

#include "cuda/kernels.h"

namespace moetrain::cuda {

// bf16 GEMMs go through cuBLASLt with algorithms chosen here: the experts' GEMMs change shape
// with every routing (an expert's rows), and choosing an algorithm afresh for each new shape
// costs more host time than a small product takes on the device. An algorithm is chosen once per
// shape class (each size rounded up to a multiple of kClass, the transposes, accumulate or not)
// and reused for every shape of the class that cuBLASLt confirms it can run.
struct GemmPlans {
  static constexpr int64_t kClass = 128;
  static constexpr std::size_t kWorkspace = std::size_t{32} << 20;
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  DeviceBuffer<unsigned char> workspace{static_cast<int64_t>(kWorkspace)};
  std::map<std::array<int64_t, 6>, cublasLtMatmulAlgo_t> algos;

  GemmPlans() {
    MOETRAIN_CUBLAS_CHECK(cublasLtCreate(&lt));
    MOETRAIN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = kWorkspace;
    MOETRAIN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  }
  ~GemmPlans() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lt) cublasLtDestroy(lt);
  }
  GemmPlans(const GemmPlans&) = delete;
  GemmPlans& operator=(const GemmPlans&) = delete;
};

void destroy(GemmPlans* p) {
  delete p;
}

namespace {

// Algorithm searches and reuses of every context in this process, for the benchmark.
std::atomic<int64_t> g_chosen{0}, g_reused{0};

// The descriptors of one column-major product D = C = op(X)·op(Y) (m, n, k) with bf16 X, Y and
// f32 C, destroyed with it.
class LtProblem {
 public:
  LtProblem(cublasOperation_t opx, cublasOperation_t opy, int m, int n, int k, int ldx, int ldy,
            int ldc) {
    MOETRAIN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    MOETRAIN_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &opx, sizeof(opx)));
    MOETRAIN_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &opy, sizeof(opy)));
    const bool xn = opx == CUBLAS_OP_N, yn = opy == CUBLAS_OP_N;
    MOETRAIN_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&x_, CUDA_R_16BF, xn ? m : k, xn ? k : m, ldx));
    MOETRAIN_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&y_, CUDA_R_16BF, yn ? k : n, yn ? n : k, ldy));
    MOETRAIN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c_, CUDA_R_32F, m, n, ldc));
  }
  ~LtProblem() {
    cublasLtMatrixLayoutDestroy(c_);
    cublasLtMatrixLayoutDestroy(y_);
    cublasLtMatrixLayoutDestroy(x_);
    cublasLtMatmulDescDestroy(op_);
  }
  LtProblem(const LtProblem&) = delete;
  LtProblem& operator=(const LtProblem&) = delete;

  // The class's algorithm where cuBLASLt can run it on this shape within the workspace, else a
  // new one chosen for this shape (and kept for the class).
  const cublasLtMatmulAlgo_t& algo(GemmPlans& p, const std::array<int64_t, 6>& key) {
    auto it = p.algos.find(key);
    cublasLtMatmulHeuristicResult_t r{};
    if (it != p.algos.end() &&
        cublasLtMatmulAlgoCheck(p.lt, op_, x_, y_, c_, c_, &it->second, &r) ==
            CUBLAS_STATUS_SUCCESS &&
        r.workspaceSize <= GemmPlans::kWorkspace) {
      ++g_reused;
      return it->second;
    }
    int found = 0;
    MOETRAIN_CUBLAS_CHECK(
        cublasLtMatmulAlgoGetHeuristic(p.lt, op_, x_, y_, c_, c_, p.pref, 1, &r, &found));
    MOETRAIN_CHECK(found > 0, "cuBLASLt has no bf16 algorithm for this product");
    ++g_chosen;
    return p.algos[key] = r.algo;
  }
  void run(GemmPlans& p, const cublasLtMatmulAlgo_t& algo, const float* alpha, const void* x,
           const void* y, const float* beta, float* c, cudaStream_t s) {
    MOETRAIN_CUBLAS_CHECK(cublasLtMatmul(p.lt, op_, alpha, x, x_, y, y_, beta, c, c_, c, c_, &algo,
                                         p.workspace.data(), GemmPlans::kWorkspace, s));
  }

 private:
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t x_ = nullptr, y_ = nullptr, c_ = nullptr;
};

int64_t size_class(int64_t x) {
  return (x + GemmPlans::kClass - 1) / GemmPlans::kClass;
}

}  // namespace

GemmPlanStats gemm_plan_stats() {
  return {g_chosen.load(), g_reused.load()};
}

void gemm(const Context& ctx, Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const float* A,
          const float* B, float* C, bool accumulate, bool exact) {
  MOETRAIN_CHECK(M >= 0 && N >= 0 && K >= 0, "cuda::gemm: negative shape M={} N={} K={}", M, N, K);
  MOETRAIN_CHECK(M < (int64_t{1} << 31) && N < (int64_t{1} << 31) && K < (int64_t{1} << 31),
                 "cuda::gemm: shape M={} N={} K={} beyond cuBLAS's 32-bit sizes", M, N, K);
  if (M == 0 || N == 0) return;
  if (K == 0 && accumulate) return;
  // cuBLAS is column-major: a row-major X (r, c) is the column-major Xᵀ. C = op(A)·op(B) is then
  // computed as Cᵀ = op(B)ᵀ·op(A)ᵀ, with the operands in their stored order and the same ops.
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const cublasOperation_t opa = ta == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t opb = tb == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  const int lda = static_cast<int>(ta == Trans::N ? K : M);
  const int ldb = static_cast<int>(tb == Trans::N ? N : K);
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  if (K == 0) {
    MOETRAIN_CUDA_CHECK(cudaMemsetAsync(C, 0, sizeof(float) * M * N, ctx.stream()));
    return;
  }
  const DeviceGemm mode = exact ? DeviceGemm::F32 : ctx.gemm_mode();
  if (mode == DeviceGemm::F32) {
    MOETRAIN_CUBLAS_CHECK(cublasSgemm(ctx.blas(), opb, opa, m, n, k, &alpha, B, ldb, A, lda, &beta,
                                      C, static_cast<int>(N)));
    return;
  }
  if (mode == DeviceGemm::TF32) {
    MOETRAIN_CUBLAS_CHECK(cublasGemmEx(ctx.blas(), opb, opa, m, n, k, &alpha, B, CUDA_R_32F, ldb, A,
                                       CUDA_R_32F, lda, &beta, C, CUDA_R_32F, static_cast<int>(N),
                                       CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
    return;
  }
  // bf16: the weights' copy where the operand is a weight, an activation's copy where one was
  // made for several GEMMs (Bf16Operand), else the operand rounded into scratch.
  auto operand = [&](const float* x, int64_t n_elems, int i) -> const uint16_t* {
    if (const uint16_t* w = ctx.bf16_copy(x, n_elems)) return w;
    uint16_t* r = ctx.scratch(i, n_elems);
    to_bf16(r, x, n_elems, ctx.stream());
    return r;
  };
  const uint16_t* a = operand(A, M * K, 0);
  const uint16_t* b = operand(B, K * N, 1);
  if (!ctx.plans()) ctx.plans().reset(new GemmPlans);
  GemmPlans& plans = *ctx.plans();
  LtProblem problem(opb, opa, m, n, k, ldb, lda, static_cast<int>(N));
  const std::array<int64_t, 6> key = {opb,           opa,           size_class(m),
                                      size_class(n), size_class(k), accumulate};
  problem.run(plans, problem.algo(plans, key), &alpha, b, a, &beta, C, ctx.stream());
}

}  // namespace moetrain::cuda
