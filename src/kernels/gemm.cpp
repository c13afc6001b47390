#include "kernels/gemm.h"

#include <dnnl.hpp>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/check.h"
#include "core/log.h"
#include "core/profile.h"

namespace moetrain {

namespace {

using dt = dnnl::memory::data_type;
constexpr int64_t kRuntime = DNNL_RUNTIME_DIM_VAL;

dnnl::engine& engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

dnnl::stream& stream() {
  // A stream belongs to one thread; each caller thread gets its own.
  thread_local dnnl::stream s(engine());
  return s;
}

// One primitive per (dtype, transposes, shape, strides, accumulate). A dimension marked kRuntime
// is bound at execution, so groups whose row counts change every step reuse one primitive.
struct Key {
  int dtype;
  int ta, tb;
  int64_t M, N, K;
  int64_t lda, ldb, ldc;
  bool accumulate;
  bool operator==(const Key&) const = default;
};

struct KeyHash {
  std::size_t operator()(const Key& k) const {
    std::size_t h = 1469598103934665603ull;
    auto mix = [&h](int64_t v) { h = (h ^ static_cast<std::size_t>(v)) * 1099511628211ull; };
    mix(k.dtype), mix(k.ta), mix(k.tb), mix(k.M), mix(k.N), mix(k.K), mix(k.lda), mix(k.ldb),
        mix(k.ldc);
    mix(k.accumulate);
    return h;
  }
};

std::mutex g_cache_mutex;
// oneDNN runs bf16 matmul only on CPUs with AVX512_BF16 / AMX (or its emulation on AVX-512), and
// f16 matmul only where the CPU has AVX512_FP16. Elsewhere the 16-bit operands are widened to
// f32: the product of two bf16 (8-bit significand) or two fp16 (11-bit) values is exact in f32,
// so the result is that of a low-precision-input, f32-accumulate GEMM, only the speed-up is lost
// — which is said once per type, at its first call. Indexed by dtype code; -1 = not yet asked.
std::atomic<int> g_native[3] = {1, -1, -1};
std::unordered_map<Key, dnnl::matmul, KeyHash> g_cache;
std::atomic<int64_t> g_built{0};

constexpr dt data_type(int code) {
  return code == 0 ? dt::f32 : code == 1 ? dt::bf16 : dt::f16;
}
constexpr const char* code_name(int code) {
  return code == 0 ? "f32" : code == 1 ? "bf16" : "fp16";
}

// Strides of a row-major (rows, cols) view of a matrix stored transposed or not with leading dim
// ld.
dnnl::memory::dims strides_of(bool trans, int64_t ld) {
  return trans ? dnnl::memory::dims{1, ld} : dnnl::memory::dims{ld, 1};
}

const dnnl::matmul& primitive(const Key& k) {
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  auto it = g_cache.find(k);
  if (it != g_cache.end()) return it->second;
  dt in_type = data_type(k.dtype);
  dnnl::memory::desc a_md({k.M, k.K}, in_type, strides_of(k.ta, k.lda));
  dnnl::memory::desc b_md({k.K, k.N}, in_type, strides_of(k.tb, k.ldb));
  dnnl::memory::desc c_md({k.M, k.N}, dt::f32, {k.ldc, 1});
  dnnl::primitive_attr attr;
  if (k.accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  dnnl::matmul::primitive_desc pd;
  try {
    pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), attr, engine());
  } catch (const dnnl::error& e) {
    MOETRAIN_FAIL("oneDNN matmul ({}x{}x{}, {}) cannot be created: {}", k.M == kRuntime ? -1 : k.M,
                  k.N, k.K == kRuntime ? -1 : k.K, code_name(k.dtype), e.what());
  }
  ++g_built;
  return g_cache.emplace(k, dnnl::matmul(pd)).first->second;
}

bool native(int code) {
  int v = g_native[code].load();
  if (v < 0) {
    dnnl::memory::desc md({1, 1}, data_type(code), {1, 1});
    dnnl::memory::desc cd({1, 1}, dt::f32, {1, 1});
    try {
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(md, md, cd), engine());
      v = 1;
    } catch (const dnnl::error&) {
      v = 0;
      log_warn(
          "oneDNN has no {} matmul on this CPU ({}): {} GEMM operands are widened to f32 "
          "(same result, no speed-up)",
          code_name(code), gemm_backend_info(), code_name(code));
    }
    g_native[code] = v;
  }
  return v == 1;
}

// Widens a (rows, cols) matrix with leading dim ld into a packed f32 buffer.
template <typename T>
void widen(std::vector<float>& out, const T* in, int64_t rows, int64_t cols, int64_t ld) {
  out.resize(static_cast<std::size_t>(rows * cols));
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = in[r * ld + c].to_float();
}

template <typename T>
constexpr int dtype_code() {
  return std::is_same_v<T, float> ? 0 : std::is_same_v<T, bf16> ? 1 : 2;
}

// Runs C = op(A) op(B) [+ C]. runtime_m / runtime_k bind that dimension (and the leading dims
// that follow from it) at execution.
template <typename T>
void run_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A, const T* B, float* C,
              bool acc, int64_t lda, int64_t ldb, int64_t ldc, bool runtime_m, bool runtime_k) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!acc) {
      for (int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(float) * N);
    }
    return;
  }
  if constexpr (!std::is_same_v<T, float>) {
    if (!native(dtype_code<T>())) {
      thread_local std::vector<float> a32, b32;
      widen(a32, A, ta ? K : M, ta ? M : K, lda);
      widen(b32, B, tb ? N : K, tb ? K : N, ldb);
      run_gemm<float>(ta, tb, M, N, K, a32.data(), b32.data(), C, acc, ta ? M : K, tb ? K : N, ldc,
                      runtime_m, runtime_k);
      return;
    }
  }
  Key key{dtype_code<T>(), ta, tb, M, N, K, lda, ldb, ldc, acc};
  // A leading dim equal to a runtime extent is runtime too.
  if (runtime_m) {
    key.M = kRuntime;
    if (ta) key.lda = kRuntime;
  }
  if (runtime_k) {
    key.K = kRuntime;
    if (!ta) key.lda = kRuntime;
    if (tb) key.ldb = kRuntime;
  }
  const dnnl::matmul& prim = primitive(key);
  dt in_type = data_type(dtype_code<T>());
  dnnl::memory a({{M, K}, in_type, strides_of(ta, lda)}, engine(), const_cast<T*>(A));
  dnnl::memory b({{K, N}, in_type, strides_of(tb, ldb)}, engine(), const_cast<T*>(B));
  dnnl::memory c({{M, N}, dt::f32, {ldc, 1}}, engine(), C);
  prim.execute(stream(), {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
  stream().wait();
}

template <typename T>
void gemm_impl(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const T* A, const T* B,
               float* C, bool acc, int64_t lda, int64_t ldb, int64_t ldc) {
  PhaseScope phase_scope(Phase::Gemm);
  MOETRAIN_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm: negative size M={} N={} K={}", M, N, K);
  bool a_t = ta == Trans::T, b_t = tb == Trans::T;
  if (lda == 0) lda = a_t ? M : K;
  if (ldb == 0) ldb = b_t ? K : N;
  if (ldc == 0) ldc = N;
  MOETRAIN_CHECK(lda >= (a_t ? M : K) && ldb >= (b_t ? K : N) && ldc >= N,
                 "gemm: leading dimensions lda={} ldb={} ldc={} too small for M={} N={} K={}", lda,
                 ldb, ldc, M, N, K);
  run_gemm(a_t, b_t, M, N, K, A, B, C, acc, lda, ldb, ldc, false, false);
}

template <typename T>
void grouped_impl(Trans tb, int64_t G, const int64_t* M, int64_t N, int64_t K, const T* A,
                  const T* B, int64_t b_stride, float* C, bool acc) {
  PhaseScope phase_scope(Phase::Gemm);
  MOETRAIN_CHECK(G >= 0 && N >= 0 && K >= 0, "grouped_gemm: negative size G={} N={} K={}", G, N, K);
  bool b_t = tb == Trans::T;
  int64_t row = 0;
  for (int64_t g = 0; g < G; ++g) {
    MOETRAIN_CHECK(M[g] >= 0, "grouped_gemm: group {} has negative row count {}", g, M[g]);
    run_gemm(false, b_t, M[g], N, K, A + row * K, B + g * b_stride, C + row * N, acc, K,
             b_t ? K : N, N, true, false);
    row += M[g];
  }
}

template <typename T>
void grouped_reduce_impl(int64_t G, const int64_t* M, int64_t P, int64_t Q, const T* A, const T* B,
                         float* C, int64_t c_stride, bool acc) {
  PhaseScope phase_scope(Phase::Gemm);
  MOETRAIN_CHECK(G >= 0 && P >= 0 && Q >= 0, "grouped_gemm_reduce: negative size G={} P={} Q={}", G,
                 P, Q);
  int64_t row = 0;
  for (int64_t g = 0; g < G; ++g) {
    MOETRAIN_CHECK(M[g] >= 0, "grouped_gemm_reduce: group {} has negative row count {}", g, M[g]);
    run_gemm(true, false, P, Q, M[g], A + row * P, B + row * Q, C + g * c_stride, acc, P, Q, Q,
             false, true);
    row += M[g];
  }
}

}  // namespace

void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const float* A, const float* B,
          float* C, bool accumulate, int64_t lda, int64_t ldb, int64_t ldc) {
  gemm_impl(ta, tb, M, N, K, A, B, C, accumulate, lda, ldb, ldc);
}
void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const bf16* A, const bf16* B,
          float* C, bool accumulate, int64_t lda, int64_t ldb, int64_t ldc) {
  gemm_impl(ta, tb, M, N, K, A, B, C, accumulate, lda, ldb, ldc);
}

void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const fp16* A, const fp16* B,
          float* C, bool accumulate, int64_t lda, int64_t ldb, int64_t ldc) {
  gemm_impl(ta, tb, M, N, K, A, B, C, accumulate, lda, ldb, ldc);
}
void gemm(DType t, Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const void* A,
          const void* B, float* C, bool accumulate, int64_t lda, int64_t ldb, int64_t ldc) {
  switch (t) {
    case DType::F32:
      return gemm(ta, tb, M, N, K, static_cast<const float*>(A), static_cast<const float*>(B), C,
                  accumulate, lda, ldb, ldc);
    case DType::BF16:
      return gemm(ta, tb, M, N, K, static_cast<const bf16*>(A), static_cast<const bf16*>(B), C,
                  accumulate, lda, ldb, ldc);
    case DType::F16:
      return gemm(ta, tb, M, N, K, static_cast<const fp16*>(A), static_cast<const fp16*>(B), C,
                  accumulate, lda, ldb, ldc);
  }
}

bool gemm_is_native(DType t) {
  return native(t == DType::F32 ? 0 : t == DType::BF16 ? 1 : 2);
}

void linear_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t IC,
                    int64_t OC) {
  gemm(Trans::N, Trans::T, N, OC, IC, inp, weight, out, false);
}

void linear_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t IC, int64_t OC) {
  if (dinp) gemm(Trans::N, Trans::N, N, IC, OC, dout, weight, dinp, false);
  if (dweight) gemm(Trans::T, Trans::N, OC, IC, N, dout, inp, dweight, true);
}

void grouped_gemm(Trans tb, int64_t G, const int64_t* M, int64_t N, int64_t K, const float* A,
                  const float* B, int64_t b_stride, float* C, bool accumulate) {
  grouped_impl(tb, G, M, N, K, A, B, b_stride, C, accumulate);
}
void grouped_gemm(Trans tb, int64_t G, const int64_t* M, int64_t N, int64_t K, const bf16* A,
                  const bf16* B, int64_t b_stride, float* C, bool accumulate) {
  grouped_impl(tb, G, M, N, K, A, B, b_stride, C, accumulate);
}
void grouped_gemm(Trans tb, int64_t G, const int64_t* M, int64_t N, int64_t K, const fp16* A,
                  const fp16* B, int64_t b_stride, float* C, bool accumulate) {
  grouped_impl(tb, G, M, N, K, A, B, b_stride, C, accumulate);
}
void grouped_gemm_reduce(int64_t G, const int64_t* M, int64_t P, int64_t Q, const float* A,
                         const float* B, float* C, int64_t c_stride, bool accumulate) {
  grouped_reduce_impl(G, M, P, Q, A, B, C, c_stride, accumulate);
}
void grouped_gemm_reduce(int64_t G, const int64_t* M, int64_t P, int64_t Q, const bf16* A,
                         const bf16* B, float* C, int64_t c_stride, bool accumulate) {
  grouped_reduce_impl(G, M, P, Q, A, B, C, c_stride, accumulate);
}

void grouped_gemm_reduce(int64_t G, const int64_t* M, int64_t P, int64_t Q, const fp16* A,
                         const fp16* B, float* C, int64_t c_stride, bool accumulate) {
  grouped_reduce_impl(G, M, P, Q, A, B, C, c_stride, accumulate);
}

int64_t gemm_primitives_built() {
  return g_built.load();
}

const char* gemm_backend_info() {
  static std::string info = [] {
    const dnnl_version_t* v = dnnl_version();
    const char* isa = "unknown";
    switch (dnnl::get_effective_cpu_isa()) {
      case dnnl::cpu_isa::sse41:
        isa = "sse41";
        break;
      case dnnl::cpu_isa::avx:
        isa = "avx";
        break;
      case dnnl::cpu_isa::avx2:
        isa = "avx2";
        break;
      case dnnl::cpu_isa::avx512_core:
        isa = "avx512_core";
        break;
      case dnnl::cpu_isa::avx512_core_vnni:
        isa = "avx512_core_vnni";
        break;
      case dnnl::cpu_isa::avx512_core_bf16:
        isa = "avx512_core_bf16";
        break;
      case dnnl::cpu_isa::avx512_core_amx:
        isa = "avx512_core_amx";
        break;
      default:
        break;
    }
    return fmt::format("oneDNN {}.{}.{}, {}", v->major, v->minor, v->patch, isa);
  }();
  return info.c_str();
}

}  // namespace moetrain
