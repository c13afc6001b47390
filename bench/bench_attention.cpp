// Causal GQA attention, forward and backward, against oneDNN GEMM doing the same multiply-adds.
// Arguments: B, T, NH, NKV, HS. The GFLOP/s counters count only the causal half of each product
// (9 products of (T²/2)·HS per head: 2 forward, 7 backward), so they compare directly with
// the reference's GFLOP/s.
#include <benchmark/benchmark.h>

#include <vector>

#include "core/rng.h"
#include "kernels/attention.h"
#include "kernels/gemm.h"

using namespace moetrain;

namespace {

std::vector<float> random(int64_t n, uint64_t seed) {
  std::vector<float> v(n);
  Rng rng(seed, rng_stream(RngPurpose::Test, 0, 0));
  rng_fill_normal(v.data(), n, rng, 0.0f, 1.0f);
  return v;
}

double causal_product_flops(int64_t B, int64_t T, int64_t NH, int64_t HS) {
  return 2.0 * B * NH * (T * (T + 1) / 2) * HS;
}

void BM_AttentionForward(benchmark::State& st) {
  const int64_t B = st.range(0), T = st.range(1), NH = st.range(2), NKV = st.range(3),
                HS = st.range(4);
  auto q = random(B * T * NH * HS, 1), k = random(B * T * NKV * HS, 2),
       v = random(B * T * NKV * HS, 3);
  std::vector<float> out(q.size()), lse(B * NH * T);
  for (auto _ : st) {
    attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, NH, NKV, HS);
    benchmark::DoNotOptimize(out.data());
  }
  st.counters["GFLOP/s"] = benchmark::Counter(2 * causal_product_flops(B, T, NH, HS) * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

// bf16: the products on bf16 operands (attention_forward_bf16), where the CPU has AVX512_BF16.
void forward_backward(benchmark::State& st, bool bf16) {
  const int64_t B = st.range(0), T = st.range(1), NH = st.range(2), NKV = st.range(3),
                HS = st.range(4);
  if (bf16 && !attention_bf16_supported(T, HS)) {
    st.SkipWithError("bf16 attention needs AVX512_BF16, even T and HS, T <= 512");
    return;
  }
  const auto forward = bf16 ? attention_forward_bf16 : attention_forward;
  const auto backward = bf16 ? attention_backward_bf16 : attention_backward;
  auto q = random(B * T * NH * HS, 1), k = random(B * T * NKV * HS, 2),
       v = random(B * T * NKV * HS, 3);
  auto dout = random(q.size(), 4);
  std::vector<float> out(q.size()), lse(B * NH * T), dq(q.size()), dk(k.size()), dv(v.size());
  for (auto _ : st) {
    forward(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, NH, NKV, HS);
    backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
             out.data(), lse.data(), B, T, NH, NKV, HS);
    benchmark::DoNotOptimize(dq.data());
  }
  st.counters["GFLOP/s"] = benchmark::Counter(9 * causal_product_flops(B, T, NH, HS) * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}
void BM_AttentionForwardBackward(benchmark::State& st) {
  forward_backward(st, false);
}
void BM_AttentionForwardBackwardBf16(benchmark::State& st) {
  forward_backward(st, true);
}

// Reference: the score product q·kᵀ for every (b, h) as one dense oneDNN GEMM each, counting only
// its causal half so the rate is comparable (dense work is twice what the rate credits).
void BM_ReferenceGemmScores(benchmark::State& st) {
  const int64_t B = st.range(0), T = st.range(1), NH = st.range(2), NKV = st.range(3),
                HS = st.range(4);
  auto q = random(B * T * NH * HS, 1), k = random(B * T * NKV * HS, 2);
  std::vector<float> s(T * T);
  const int64_t G = NH / NKV;
  auto scores = [&] {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < NH; ++h) {
        gemm(Trans::N, Trans::T, T, T, HS, q.data() + (b * T * NH + h) * HS,
             k.data() + (b * T * NKV + h / G) * HS, s.data(), false, NH * HS, NKV * HS, T);
      }
    }
  };
  scores();  // builds the primitive outside the timed loop
  for (auto _ : st) {
    scores();
    benchmark::DoNotOptimize(s.data());
  }
  st.counters["GFLOP/s"] = benchmark::Counter(causal_product_flops(B, T, NH, HS) * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

void shapes(benchmark::internal::Benchmark* b) {
  b->Args({4, 256, 8, 2, 64})
      ->Args({1, 1024, 8, 2, 64})
      ->Args({16, 256, 8, 8, 32})
      ->Args({64, 64, 4, 2, 32})   // the demo's (make demo) shape
      ->Args({16, 128, 4, 2, 32})  // configs/tiny.toml, bench_train_step's tiny preset
      ->Args({8, 256, 8, 8, 64})   // bench_train_step's large preset
      ->Unit(benchmark::kMillisecond);
  b->UseRealTime();
}

}  // namespace

BENCHMARK(BM_AttentionForward)->Apply(shapes);
BENCHMARK(BM_AttentionForwardBackward)->Apply(shapes);
BENCHMARK(BM_AttentionForwardBackwardBf16)->Apply(shapes);
BENCHMARK(BM_ReferenceGemmScores)->Apply(shapes);

BENCHMARK_MAIN();
