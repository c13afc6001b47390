// cuBLAS and cuBLASLt, loaded when the first of their functions is called instead of when the
// program starts. Linked normally, their libraries are mapped and relocated at every start of
// `moetrain` — about 150 MB of resident memory for cuBLASLt alone — although only a run with
// train.device = cuda calls them: `moetrain plan` or a CPU run would carry them for nothing.
//
// Each function the backend calls is defined here under its own name (cublas_v2.h maps
// cublasCreate to cublasCreate_v2 and so on) and forwards to the library's definition, resolved
// once with dlsym. The libraries are found as the dynamic linker finds any (LD_LIBRARY_PATH, the
// program's run path, ld.so.cache), then in the toolkit's directory the build was configured
// with. A function the backend starts to call must be added here: the link fails naming it.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <dlfcn.h>

#include <mutex>
#include <string>

#include "core/check.h"

namespace moetrain {
namespace {

enum Lib { Blas, BlasLt };

void* library(Lib which) {
  static void* handles[2] = {nullptr, nullptr};
  static std::once_flag once[2];
  std::call_once(once[which], [which] {
    const std::string name = std::string(which == Blas ? "libcublas.so." : "libcublasLt.so.") +
                             MOETRAIN_CUBLAS_MAJOR;
    void* h = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    std::string first = h ? "" : ::dlerror();
    if (!h) h = ::dlopen((std::string(MOETRAIN_CUDA_LIBRARY_DIR) + "/" + name).c_str(),
                         RTLD_NOW | RTLD_LOCAL);
    MOETRAIN_CHECK(h != nullptr,
                   "train.device = cuda: cannot load {} ({}; nor from {}: {}); install the CUDA "
                   "toolkit's cuBLAS or add its directory to LD_LIBRARY_PATH",
                   name, first, MOETRAIN_CUDA_LIBRARY_DIR, ::dlerror());
    handles[which] = h;
  });
  return handles[which];
}

template <class F>
F* symbol(Lib which, const char* name) {
  void* s = ::dlsym(library(which), name);
  MOETRAIN_CHECK(s != nullptr, "train.device = cuda: {} has no {}",
                 which == Blas ? "cuBLAS" : "cuBLASLt", name);
  return reinterpret_cast<F*>(s);
}

}  // namespace
}  // namespace moetrain

// ret name(params) { return <the library's name>(args); }, resolved on the first call.
#define MOETRAIN_LAZY(lib, ret, name, params, args)                           \
  extern "C" ret CUBLASWINAPI name params {                                   \
    static ret(*const fn) params = moetrain::symbol<ret params>(lib, #name); \
    return fn args;                                                            \
  }

using moetrain::Blas;
using moetrain::BlasLt;

MOETRAIN_LAZY(Blas, cublasStatus_t, cublasCreate_v2, (cublasHandle_t * h), (h))
MOETRAIN_LAZY(Blas, cublasStatus_t, cublasDestroy_v2, (cublasHandle_t h), (h))
MOETRAIN_LAZY(Blas, const char*, cublasGetStatusString, (cublasStatus_t s), (s))
MOETRAIN_LAZY(Blas, cublasStatus_t, cublasSetMathMode, (cublasHandle_t h, cublasMath_t mode),
              (h, mode))
MOETRAIN_LAZY(Blas, cublasStatus_t, cublasSetStream_v2, (cublasHandle_t h, cudaStream_t stream),
              (h, stream))
MOETRAIN_LAZY(Blas, cublasStatus_t, cublasSgemm_v2,
              (cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
               const float* alpha, const float* A, int lda, const float* B, int ldb,
               const float* beta, float* C, int ldc),
              (h, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc))
MOETRAIN_LAZY(Blas, cublasStatus_t, cublasGemmEx,
              (cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
               const void* alpha, const void* A, cudaDataType at, int lda, const void* B,
               cudaDataType bt, int ldb, const void* beta, void* C, cudaDataType ct, int ldc,
               cublasComputeType_t compute, cublasGemmAlgo_t algo),
              (h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc, compute, algo))
MOETRAIN_LAZY(Blas, cublasStatus_t, cublasGemmStridedBatchedEx,
              (cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
               const void* alpha, const void* A, cudaDataType at, int lda, long long int sa,
               const void* B, cudaDataType bt, int ldb, long long int sb, const void* beta,
               void* C, cudaDataType ct, int ldc, long long int sc, int batch,
               cublasComputeType_t compute, cublasGemmAlgo_t algo),
              (h, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc,
               batch, compute, algo))

MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtCreate, (cublasLtHandle_t * h), (h))
MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtDestroy, (cublasLtHandle_t h), (h))
MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtMatmul,
              (cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void* alpha, const void* A,
               cublasLtMatrixLayout_t ad, const void* B, cublasLtMatrixLayout_t bd,
               const void* beta, const void* C, cublasLtMatrixLayout_t cd, void* D,
               cublasLtMatrixLayout_t dd, const cublasLtMatmulAlgo_t* algo, void* workspace,
               size_t workspace_bytes, cudaStream_t stream),
              (h, op, alpha, A, ad, B, bd, beta, C, cd, D, dd, algo, workspace, workspace_bytes,
               stream))
MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtMatmulAlgoCheck,
              (cublasLtHandle_t h, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t ad,
               cublasLtMatrixLayout_t bd, cublasLtMatrixLayout_t cd, cublasLtMatrixLayout_t dd,
               const cublasLtMatmulAlgo_t* algo, cublasLtMatmulHeuristicResult_t* result),
              (h, op, ad, bd, cd, dd, algo, result))
MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtMatmulAlgoGetHeuristic,
              (cublasLtHandle_t h, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t ad,
               cublasLtMatrixLayout_t bd, cublasLtMatrixLayout_t cd, cublasLtMatrixLayout_t dd,
               cublasLtMatmulPreference_t pref, int requested,
               cublasLtMatmulHeuristicResult_t results[], int* returned),
              (h, op, ad, bd, cd, dd, pref, requested, results, returned))
MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtMatmulDescCreate,
              (cublasLtMatmulDesc_t * d, cublasComputeType_t compute, cudaDataType_t scale),
              (d, compute, scale))
MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t d), (d))
MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtMatmulDescSetAttribute,
              (cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const void* buf,
               size_t bytes),
              (d, attr, buf, bytes))
MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtMatmulPreferenceCreate,
              (cublasLtMatmulPreference_t * p), (p))
MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtMatmulPreferenceDestroy,
              (cublasLtMatmulPreference_t p), (p))
MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtMatmulPreferenceSetAttribute,
              (cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr,
               const void* buf, size_t bytes),
              (p, attr, buf, bytes))
MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtMatrixLayoutCreate,
              (cublasLtMatrixLayout_t * l, cudaDataType type, uint64_t rows, uint64_t cols,
               int64_t ld),
              (l, type, rows, cols, ld))
MOETRAIN_LAZY(BlasLt, cublasStatus_t, cublasLtMatrixLayoutDestroy, (cublasLtMatrixLayout_t l),
              (l))
