// GEMM throughput at the MoE shapes, through our wrapper ("ours/...") and through a raw oneDNN
// matmul primitive created once with the same fixed shape ("onednn/..."), in the same run, so
// PERF.md can quote ratios. Also the grouped GEMM over 8 groups against one GEMM of the same
// total M. Counter GFLOPs = 2·M·N·K per iteration.
#include <benchmark/benchmark.h>

#include <dnnl.hpp>
#include <vector>

#include "core/dtype.h"
#include "core/rng.h"
#include "core/threads.h"
#include "kernels/det_gemm.h"
#include "kernels/gemm.h"

using namespace moetrain;

namespace {

// (M, N, K): tokens × out × in. M ≥ 64 everywhere, the regime the wrapper target is set for.
const std::vector<std::vector<int64_t>> kShapes = {
    {4096, 1024, 512}, {1024, 512, 1024}, {512, 1024, 256}};

template <typename T>
std::vector<T> random_buffer(int64_t n, uint64_t seed) {
  std::vector<float> f(n);
  rng_fill_normal(f.data(), n, Rng(seed, 1), 0, 1);
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    std::vector<bf16> b(n);
    f32_to_bf16(b.data(), f.data(), n);
    return b;
  }
}

void set_flops(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOPs"] =
      benchmark::Counter(flops_per_iter * state.iterations() * 1e-9, benchmark::Counter::kIsRate);
}

// C (M,N) = A (M,K) · Bᵀ, B stored (N,K): the layout of a Linear layer's forward.
template <typename T>
void BM_ours(benchmark::State& state) {
  int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  auto A = random_buffer<T>(M * K, 1);
  auto B = random_buffer<T>(N * K, 2);
  std::vector<float> C(M * N);
  for (auto _ : state) {
    gemm(Trans::N, Trans::T, M, N, K, A.data(), B.data(), C.data(), false);
    benchmark::DoNotOptimize(C.data());
  }
  set_flops(state, 2.0 * M * N * K);
}

template <typename T>
void BM_onednn(benchmark::State& state) {
  using dt = dnnl::memory::data_type;
  int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  dt in = std::is_same_v<T, float> ? dt::f32 : dt::bf16;
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream strm(eng);
  dnnl::memory::desc a_md({M, K}, in, {K, 1}), b_md({K, N}, in, {1, K}),
      c_md({M, N}, dt::f32, {N, 1});
  dnnl::matmul::primitive_desc pd;
  try {
    pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), eng);
  } catch (const dnnl::error&) {
    state.SkipWithError("oneDNN has no matmul for this dtype on this CPU");
    return;
  }
  dnnl::matmul prim(pd);
  auto A = random_buffer<T>(M * K, 1);
  auto B = random_buffer<T>(N * K, 2);
  std::vector<float> C(M * N);
  dnnl::memory a(a_md, eng, A.data()), b(b_md, eng, B.data()), c(c_md, eng, C.data());
  for (auto _ : state) {
    prim.execute(strm, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    strm.wait();
    benchmark::DoNotOptimize(C.data());
  }
  set_flops(state, 2.0 * M * N * K);
}

// 8 experts with uneven row counts summing to M, each with its own weights, vs one GEMM of M rows.
template <bool kTaskParallel>
void BM_grouped8(benchmark::State& state) {
  int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  const int64_t G = 8;
  std::vector<int64_t> rows(G);
  int64_t left = M;
  for (int64_t g = 0; g < G; ++g) {
    // A skew like a real router's: 1.5x, 0.5x, ... around the mean, remainder to the last group.
    rows[g] = g == G - 1 ? left : (M / G) * (g % 2 ? 1 : 3) / 2;
    left -= rows[g];
  }
  auto A = random_buffer<float>(M * K, 1);
  auto B = random_buffer<float>(G * N * K, 2);
  std::vector<float> C(M * N);
  for (auto _ : state) {
    if constexpr (kTaskParallel) {
      grouped_gemm_det(Trans::T, G, rows.data(), N, K, A.data(), B.data(), N * K, C.data(), false);
    } else {
      grouped_gemm(Trans::T, G, rows.data(), N, K, A.data(), B.data(), N * K, C.data(), false);
    }
    benchmark::DoNotOptimize(C.data());
  }
  set_flops(state, 2.0 * M * N * K);
}

void shapes(benchmark::internal::Benchmark* b) {
  for (auto& s : kShapes) b->Args(s);
  b->ArgNames({"M", "N", "K"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_onednn<float>)->Name("onednn/f32")->Apply(shapes);
BENCHMARK(BM_ours<float>)->Name("ours/f32")->Apply(shapes);
BENCHMARK(BM_onednn<bf16>)->Name("onednn/bf16")->Apply(shapes);
BENCHMARK(BM_ours<bf16>)->Name("ours/bf16")->Apply(shapes);
// Each group one multi-threaded oneDNN call, vs the experts' scheduler: 512-row tasks over the
// threads, each a single-threaded oneDNN call (kernels/det_gemm.h).
BENCHMARK(BM_grouped8<false>)->Name("ours/grouped8_f32")->Apply(shapes);
BENCHMARK(BM_grouped8<true>)->Name("ours/grouped8_tasks_f32")->Apply(shapes);

int main(int argc, char** argv) {
  init_threads();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("gemm_backend", gemm_backend_info());
  benchmark::AddCustomContext("threads", std::to_string(num_threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
