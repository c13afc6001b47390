// MoE layer forward+backward (f32 or bf16 GEMM operands, topk_softmax, dropless) against a raw
// oneDNN matmul doing the same expert GEMM work, in the same run:
//   moe_layer/...  one forward + backward per iteration; counters:
//     expert_GFLOPs      expert GEMM FLOPs / time of the expert stage (its GEMMs and the SwiGLU
//                        between them, which run fused per row block)
//     raw_GFLOPs         the same FLOPs through 9 fixed-shape oneDNN primitives (created once) with
//                        M = N·K rows at one expert's shapes, run after every layer iteration
//                        (outside the benchmark's timing), so both see the same machine load
//     ratio_to_raw       expert_GFLOPs / raw_GFLOPs (target ≥ 0.8)
//     outside_experts    share of layer time outside the expert stage: router, layout + permute,
//                        combine, losses (target ≤ 0.1)
//     *_ms               stage times per iteration
//   raw_expert_gemms/... the raw reference alone.
//   moe_layer/topk_softmax_bf16, raw_expert_gemms/bf16: the same with bf16 operands (f32
//     accumulation); the raw reference is the nine GEMMs through kernels/gemm.h with bf16
//     operands, i.e. oneDNN's bf16 matmul where the CPU has it (bf16_native = 1) and the widened
//     f32 path elsewhere (bf16_native = 0: then no bf16 speed-up can be measured).
// Expert GEMM FLOPs per routed row: forward 3·2CF, backward 6·2CF (data + weight gradients).
#include <benchmark/benchmark.h>

#include <dnnl.hpp>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/threads.h"
#include "core/timer.h"
#include "kernels/gemm.h"
#include "moe/moe_layer.h"

using namespace moetrain;

namespace {

std::vector<float> random_buffer(int64_t n, uint64_t seed, float stddev) {
  std::vector<float> v(n);
  rng_fill_normal(v.data(), n, Rng(seed, 1), 0.0f, stddev);
  return v;
}

// The nine expert GEMMs at M rows as fixed-shape oneDNN matmuls, with our layouts:
// weights (F, C) / (C, F) read transposed in the forward, plain in the backward data GEMMs.
class RawExpertGemms {
 public:
  RawExpertGemms(int64_t M, int64_t C, int64_t F) : eng_(dnnl::engine::kind::cpu, 0), strm_(eng_) {
    x_ = random_buffer(M * C, 1, 1.0f), w1_ = random_buffer(F * C, 2, 0.05f),
    w2_ = random_buffer(C * F, 3, 0.05f);
    a_.resize(M * F), b_.resize(M * F), y_.resize(M * C), dw1_.resize(F * C), dw2_.resize(C * F);
    // (src, weights, dst) with (rows, cols, row stride, col stride) each.
    add(M, F, C, x_.data(), {C, 1}, w1_.data(), {1, C}, a_.data());   // a = x·W1ᵀ
    add(M, F, C, x_.data(), {C, 1}, w1_.data(), {1, C}, b_.data());   // b = x·W3ᵀ
    add(M, C, F, a_.data(), {F, 1}, w2_.data(), {1, F}, y_.data());   // y = g·W2ᵀ
    add(M, F, C, y_.data(), {C, 1}, w2_.data(), {F, 1}, a_.data());   // dg = dy·W2
    add(M, C, F, a_.data(), {F, 1}, w1_.data(), {C, 1}, y_.data());   // dx = da·W1
    add(M, C, F, b_.data(), {F, 1}, w1_.data(), {C, 1}, y_.data());   // dx += db·W3
    add(C, F, M, y_.data(), {1, C}, a_.data(), {F, 1}, dw2_.data());  // dW2 = dyᵀ·g
    add(F, C, M, a_.data(), {1, F}, x_.data(), {C, 1}, dw1_.data());  // dW1 = daᵀ·x
    add(F, C, M, b_.data(), {1, F}, x_.data(), {C, 1}, dw1_.data());  // dW3 = dbᵀ·x
  }
  void run() {
    for (Op& op : ops_) op.prim.execute(strm_, op.args);
    strm_.wait();
  }

 private:
  struct Op {
    dnnl::matmul prim;
    std::unordered_map<int, dnnl::memory> args;
  };
  void add(int64_t M, int64_t N, int64_t K, float* A, dnnl::memory::dims sa, float* B,
           dnnl::memory::dims sb, float* Cp) {
    using dt = dnnl::memory::data_type;
    dnnl::memory::desc a_md({M, K}, dt::f32, sa), b_md({K, N}, dt::f32, sb),
        c_md({M, N}, dt::f32, {N, 1});
    dnnl::matmul prim(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), eng_));
    ops_.push_back({prim,
                    {{DNNL_ARG_SRC, dnnl::memory(a_md, eng_, A)},
                     {DNNL_ARG_WEIGHTS, dnnl::memory(b_md, eng_, B)},
                     {DNNL_ARG_DST, dnnl::memory(c_md, eng_, Cp)}}});
  }
  dnnl::engine eng_;
  dnnl::stream strm_;
  std::vector<Op> ops_;
  std::vector<float> x_, w1_, w2_, a_, b_, y_, dw1_, dw2_;
};

// The nine expert GEMMs through kernels/gemm.h on bf16 operands (cached oneDNN primitives).
class RawExpertGemmsBf16 {
 public:
  RawExpertGemmsBf16(int64_t M, int64_t C, int64_t F) : M_(M), C_(C), F_(F) {
    x_ = lp(random_buffer(M * C, 1, 1.0f)), w1_ = lp(random_buffer(F * C, 2, 0.05f));
    w2_ = lp(random_buffer(C * F, 3, 0.05f));
    a_ = lp(random_buffer(M * F, 4, 1.0f)), b_ = lp(random_buffer(M * F, 5, 1.0f));
    y_ = lp(random_buffer(M * C, 6, 1.0f));
    oa_.resize(M * F), ob_.resize(M * F), oy_.resize(M * C), dw1_.resize(F * C), dw2_.resize(C * F);
  }
  void run() {
    const int64_t M = M_, C = C_, F = F_;
    gemm(Trans::N, Trans::T, M, F, C, x_.data(), w1_.data(), oa_.data(), false);  // a = x·W1ᵀ
    gemm(Trans::N, Trans::T, M, F, C, x_.data(), w1_.data(), ob_.data(), false);  // b = x·W3ᵀ
    gemm(Trans::N, Trans::T, M, C, F, a_.data(), w2_.data(), oy_.data(), false);  // y = g·W2ᵀ
    gemm(Trans::N, Trans::N, M, F, C, y_.data(), w2_.data(), oa_.data(), false);  // dg = dy·W2
    gemm(Trans::N, Trans::N, M, C, F, a_.data(), w1_.data(), oy_.data(), false);  // dx = da·W1
    gemm(Trans::N, Trans::N, M, C, F, b_.data(), w1_.data(), oy_.data(), true);   // dx += db·W3
    gemm(Trans::T, Trans::N, C, F, M, y_.data(), a_.data(), dw2_.data(), false);  // dW2 = dyᵀ·g
    gemm(Trans::T, Trans::N, F, C, M, a_.data(), x_.data(), dw1_.data(), false);  // dW1 = daᵀ·x
    gemm(Trans::T, Trans::N, F, C, M, b_.data(), x_.data(), dw1_.data(), false);  // dW3 = dbᵀ·x
  }

 private:
  static std::vector<bf16> lp(const std::vector<float>& v) {
    std::vector<bf16> out(v.size());
    f32_to_bf16(out.data(), v.data(), v.size());
    return out;
  }
  int64_t M_, C_, F_;
  std::vector<bf16> x_, w1_, w2_, a_, b_, y_;
  std::vector<float> oa_, ob_, oy_, dw1_, dw2_;
};

double expert_flops(int64_t rows, int64_t C, int64_t F) {
  return 18.0 * double(rows) * double(C) * double(F);
}

void BM_MoeLayer(benchmark::State& state) {
  MoeConfig cfg;
  cfg.C = state.range(0), cfg.F = state.range(1), cfg.E = state.range(2), cfg.K = state.range(3);
  const int64_t N = state.range(4);
  cfg.router = RouterKind::TopKSoftmax;
  MoeParamSizes sizes = moe_param_sizes(cfg);
  std::vector<float> params = random_buffer(sizes.total(), 7, 0.05f), grads(sizes.total(), 0.0f);
  MoeWeights w = moe_weights_from_buffer(cfg, params.data()),
             g = moe_weights_from_buffer(cfg, grads.data());
  std::vector<float> inp = random_buffer(N * cfg.C, 8, 1.0f),
                     dout = random_buffer(N * cfg.C, 9, 1e-3f);
  std::vector<float> out(N * cfg.C), dinp(N * cfg.C);
  const bool bf = state.range(5) == 1;
  std::vector<bf16> copy;
  if (bf) {
    // The bf16 weight copy a mixed-precision model refreshes after each optimizer step.
    copy.resize(params.size());
    f32_to_bf16(copy.data(), params.data(), params.size());
    auto at = [&](const float* f) -> const void* {
      return f ? copy.data() + (f - params.data()) : nullptr;
    };
    w.lp = DType::BF16;
    w.w1_lp = at(w.w1), w.w3_lp = at(w.w3), w.w2_lp = at(w.w2);
  }
  MoeLayer layer(cfg);
  MoeStep step;
  const int64_t rows = N * cfg.K;
  const double flops = expert_flops(rows, cfg.C, cfg.F);
  RawExpertGemms raw32(rows, cfg.C, cfg.F);
  std::unique_ptr<RawExpertGemmsBf16> raw16;
  if (bf) raw16 = std::make_unique<RawExpertGemmsBf16>(rows, cfg.C, cfg.F);
  auto raw_run = [&] { bf ? raw16->run() : raw32.run(); };
  // Warm-up: primitives, buffers.
  layer.forward(out.data(), inp.data(), N, w, step);
  layer.backward(dinp.data(), dout.data(), w, g, 1.0f);
  raw_run();

  MoeTimings sum;
  double wall = 0, raw_total = 0;
  for (auto _ : state) {
    Timer t;
    layer.forward(out.data(), inp.data(), N, w, step);
    layer.backward(dinp.data(), dout.data(), w, g, 1.0f);
    wall += t.seconds();
    const MoeTimings& s = layer.timings();
    sum.router += s.router, sum.permute += s.permute, sum.experts += s.experts;
    sum.combine += s.combine, sum.losses += s.losses;
    benchmark::DoNotOptimize(dinp.data());
    state.PauseTiming();
    Timer r;
    raw_run();
    raw_total += r.seconds();
    state.ResumeTiming();
  }
  const double iters = double(state.iterations());
  const double raw_s = raw_total / iters;
  const double expert_s = sum.experts / iters;
  auto& c = state.counters;
  c["expert_GFLOPs"] = flops / expert_s * 1e-9;
  c["raw_GFLOPs"] = flops / raw_s * 1e-9;
  c["ratio_to_raw"] = raw_s / expert_s;
  c["outside_experts"] = 1.0 - sum.experts / wall;
  c["experts_ms"] = expert_s * 1e3;
  c["router_ms"] = sum.router / iters * 1e3;
  c["permute_ms"] = sum.permute / iters * 1e3;
  c["combine_ms"] = sum.combine / iters * 1e3;
  c["losses_ms"] = sum.losses / iters * 1e3;
  if (bf) c["bf16_native"] = gemm_is_native(DType::BF16) ? 1 : 0;
}

void BM_RawExpertGemms(benchmark::State& state) {
  const int64_t C = state.range(0), F = state.range(1), K = state.range(3), N = state.range(4);
  RawExpertGemms raw(N * K, C, F);
  raw.run();
  for (auto _ : state) raw.run();
  state.counters["GFLOPs"] = benchmark::Counter(
      expert_flops(N * K, C, F) * double(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

void BM_RawExpertGemmsBf16(benchmark::State& state) {
  const int64_t C = state.range(0), F = state.range(1), K = state.range(3), N = state.range(4);
  RawExpertGemmsBf16 raw(N * K, C, F);
  raw.run();
  for (auto _ : state) raw.run();
  state.counters["bf16_native"] = gemm_is_native(DType::BF16) ? 1 : 0;
  state.counters["GFLOPs"] = benchmark::Counter(
      expert_flops(N * K, C, F) * double(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

// The last argument picks the GEMM operand type of the layer: 0 f32, 1 bf16.
template <int kBf16>
void shapes(benchmark::internal::Benchmark* b) {
  b->Args({512, 1024, 8, 2, 4096, kBf16});  // Mixtral-like
  b->Args({512, 256, 64, 6, 4096, kBf16});  // fine-grained (DeepSeekMoE-like)
  b->Args({128, 256, 8, 2, 2048, kBf16});   // configs/tiny.toml, bench_train_step's tiny preset
  b->ArgNames({"C", "F", "E", "K", "N", "bf16"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_MoeLayer)->Name("moe_layer/topk_softmax_f32")->Apply(shapes<0>);
BENCHMARK(BM_RawExpertGemms)->Name("raw_expert_gemms/f32")->Apply(shapes<0>);
BENCHMARK(BM_MoeLayer)->Name("moe_layer/topk_softmax_bf16")->Apply(shapes<1>);
BENCHMARK(BM_RawExpertGemmsBf16)->Name("raw_expert_gemms/bf16")->Apply(shapes<1>);

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
