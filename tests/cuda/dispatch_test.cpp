// cuda::permute_* and cuda::combine_* against the CPU functions of moe/dispatch.h on layouts that
// build_layout makes from real routings (empty and capacity-dropped slots, an expert with no rows,
// no rows at all). The device sums a token's slots in slot order with the CPU's float operations,
// so everything is compared bitwise except combine_backward's dweight, a C-term dot product summed
// in another order, which is held to the error bound of such a product.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/kernels.h"
#include "moe/dispatch.h"
#include "moe/router.h"
#include "support/error_bound.h"
#include "support/device_buffers.h"

namespace {

using namespace moetrain::testing;

using moetrain::cuda::DeviceBuffer;

std::vector<float> random_vector(std::mt19937& rng, int64_t n, float lo = -1.0f,
                                 float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

struct Case {
  int64_t N, E, S, C;
  double empty;      // probability that a slot is left empty by the router
  int64_t capacity;  // apply_capacity's per-expert limit, or -1 for none
  uint32_t seed;
};

std::string describe(const Case& k) {
  return "N=" + std::to_string(k.N) + " E=" + std::to_string(k.E) + " S=" + std::to_string(k.S) +
         " C=" + std::to_string(k.C) + " capacity=" + std::to_string(k.capacity);
}

// A token-choice routing: S distinct experts per token from [0, E − 1), so expert E − 1 never has
// a row; each slot left empty (expert −1, weight 0) with probability k.empty; then capacity
// dropping, which sets expert −1 and keeps the weight, as the MoE layer does.
moetrain::Routing make_routing(const Case& k) {
  moetrain::Routing r;
  r.N = k.N, r.E = k.E, r.S = k.S;
  r.selected.resize(k.N * k.S);
  r.weight.resize(k.N * k.S);
  std::mt19937 rng(k.seed);
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  std::bernoulli_distribution empty(k.empty);
  std::vector<int32_t> experts(k.E - 1);
  for (int64_t t = 0; t < k.N; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int64_t s = 0; s < k.S; ++s) {
      const int64_t i = t * k.S + s;
      r.selected[i] = experts[s];
      r.weight[i] = weight(rng);
      if (empty(rng)) r.selected[i] = -1, r.weight[i] = 0.0f;
    }
  }
  r.expert = r.selected;
  if (k.capacity >= 0) moetrain::apply_capacity(r, k.capacity);
  return r;
}

// The layout arrays the device kernels read.
struct DeviceLayout {
  DeviceBuffer<int32_t> row_token, slot_row;
  DeviceBuffer<float> row_weight;
  explicit DeviceLayout(const moetrain::DispatchLayout& l)
      : row_token(to_device(l.row_token)),
        slot_row(to_device(l.slot_row)),
        row_weight(to_device(l.row_weight)) {}
};

// The outputs of one pass of the four functions: the non-accumulating ones from scratch, the
// accumulating ones on top of dinp0 / out0.
struct Results {
  std::vector<float> xp, dinp, dinp_acc, out, out_acc, dy, dweight;
};

struct Inputs {
  std::vector<float> inp, dxp, y, dout, dinp0, out0;  // (N, C), (R, C), (R, C), (N, C), (N, C)x2
};

Results run_cpu(const moetrain::DispatchLayout& l, const Inputs& in, int64_t C) {
  const int64_t N = l.N, S = l.S, R = l.R;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Results r{std::vector<float>(R * C, nan), std::vector<float>(N * C, nan), in.dinp0,
            std::vector<float>(N * C, nan), in.out0,
            std::vector<float>(R * C, nan), std::vector<float>(N * S, nan)};
  moetrain::permute_forward(r.xp.data(), in.inp.data(), l, C);
  moetrain::permute_backward(r.dinp.data(), in.dxp.data(), l, C, false);
  moetrain::permute_backward(r.dinp_acc.data(), in.dxp.data(), l, C, true);
  moetrain::combine_forward(r.out.data(), in.y.data(), l, C, false);
  moetrain::combine_forward(r.out_acc.data(), in.y.data(), l, C, true);
  moetrain::combine_backward(r.dy.data(), r.dweight.data(), in.dout.data(), in.y.data(), l, C);
  return r;
}

// One device pass; non-accumulating outputs start as NaN so that a missed element shows.
Results run_device(const moetrain::cuda::Context& ctx, const moetrain::DispatchLayout& l,
                   const Inputs& in, int64_t C) {
  namespace cuda = moetrain::cuda;
  const int64_t N = l.N, S = l.S, R = l.R;
  const cudaStream_t s = ctx.stream();
  DeviceLayout d(l);
  DeviceBuffer<float> inp = to_device(in.inp), dxp = to_device(in.dxp), y = to_device(in.y),
                      dout = to_device(in.dout), dinp_acc = to_device(in.dinp0),
                      out_acc = to_device(in.out0);
  DeviceBuffer<float> xp(R * C), dinp(N * C), out(N * C), dy(R * C), dweight(N * S);
  uploads_done();
  for (DeviceBuffer<float>* b : {&xp, &dinp, &out, &dy, &dweight}) poison(*b, s);

  cuda::permute_forward(xp.data(), inp.data(), d.row_token.data(), R, C, s);
  cuda::permute_backward(dinp.data(), dxp.data(), d.slot_row.data(), N, S, C, false, s);
  cuda::permute_backward(dinp_acc.data(), dxp.data(), d.slot_row.data(), N, S, C, true, s);
  cuda::combine_forward(out.data(), y.data(), d.slot_row.data(), d.row_weight.data(), N, S, C,
                        false, s);
  cuda::combine_forward(out_acc.data(), y.data(), d.slot_row.data(), d.row_weight.data(), N, S, C,
                        true, s);
  cuda::combine_backward(dy.data(), dweight.data(), dout.data(), y.data(), d.slot_row.data(),
                         d.row_weight.data(), N, S, C, s);
  ctx.sync();
  return {to_host(xp),  to_host(dinp), to_host(dinp_acc), to_host(out),
          to_host(out_acc), to_host(dy), to_host(dweight)};
}

// dweight's reference: in double, with the bound of a C-term float dot product summed in any
// order, with or without FMA (error_bound.h): γ_C·Σ_c |dout[t,c]·y[row,c]| (γ_C = C·u/(1 − C·u),
// u = 2^-24) plus C·2^-126 for subnormal products. Empty slots must be exactly 0.
std::vector<moetrain::testing::Bounded> dweight_reference(const moetrain::DispatchLayout& l,
                                                          const Inputs& in, int64_t C) {
  std::vector<moetrain::testing::Bounded> ref(l.N * l.S);
  for (int64_t t = 0; t < l.N; ++t) {
    for (int64_t s = 0; s < l.S; ++s) {
      const int64_t row = l.slot_row[t * l.S + s];
      if (row < 0) continue;  // {0, 0}: exactly zero
      moetrain::testing::BoundedSum dot;
      for (int64_t c = 0; c < C; ++c) dot.add(in.dout[t * C + c], in.y[row * C + c]);
      ref[t * l.S + s] = dot.result();
    }
  }
  return ref;
}

void check_case(const Case& k) {
  SCOPED_TRACE(describe(k));
  const moetrain::Routing routing = make_routing(k);
  moetrain::DispatchLayout l;
  moetrain::build_layout(l, routing);
  const int64_t N = k.N, C = k.C, R = l.R;
  ASSERT_EQ(l.counts[k.E - 1], 0) << "the last expert must have no rows";

  std::mt19937 rng(k.seed + 1000);
  Inputs in;
  in.inp = random_vector(rng, N * C);
  in.dxp = random_vector(rng, R * C);
  in.y = random_vector(rng, R * C);
  in.dout = random_vector(rng, N * C);
  in.dinp0 = random_vector(rng, N * C);
  in.out0 = random_vector(rng, N * C);

  const Results cpu = run_cpu(l, in, C);
  const moetrain::cuda::Context ctx;
  const Results dev = run_device(ctx, l, in, C);
  expect_same_bits(dev.xp, cpu.xp, "permute_forward xp");
  expect_same_bits(dev.dinp, cpu.dinp, "permute_backward dinp");
  expect_same_bits(dev.dinp_acc, cpu.dinp_acc, "permute_backward dinp (accumulating)");
  expect_same_bits(dev.out, cpu.out, "combine_forward out");
  expect_same_bits(dev.out_acc, cpu.out_acc, "combine_forward out (accumulating)");
  expect_same_bits(dev.dy, cpu.dy, "combine_backward dy");

  const std::vector<moetrain::testing::Bounded> ref = dweight_reference(l, in, C);
  moetrain::testing::expect_within(dev.dweight, ref, "combine_backward dweight (device)");
  moetrain::testing::expect_within(cpu.dweight, ref, "combine_backward dweight (CPU)");
  for (int64_t i = 0; i < N * k.S; ++i) {
    if (l.slot_row[i] < 0) {
      EXPECT_EQ(std::bit_cast<uint32_t>(dev.dweight[i]), 0u) << "empty slot " << i;
    }
  }

  // No atomics and a fixed reduction order: a second pass gives the same bits.
  const Results again = run_device(ctx, l, in, C);
  expect_same_bits(again.xp, dev.xp, "repeat xp");
  expect_same_bits(again.dinp, dev.dinp, "repeat dinp");
  expect_same_bits(again.dinp_acc, dev.dinp_acc, "repeat dinp (accumulating)");
  expect_same_bits(again.out, dev.out, "repeat out");
  expect_same_bits(again.out_acc, dev.out_acc, "repeat out (accumulating)");
  expect_same_bits(again.dy, dev.dy, "repeat dy");
  expect_same_bits(again.dweight, dev.dweight, "repeat dweight");
}

}  // namespace

TEST(CudaDispatch, SingleTokenSingleSlot) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  check_case({1, 2, 1, 1, 0.0, -1, 1});
  check_case({1, 3, 1, 45, 0.0, -1, 2});
}

TEST(CudaDispatch, SingleTokenThreeSlots) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  check_case({1, 4, 3, 7, 0.0, -1, 3});
  check_case({1, 5, 3, 64, 0.4, -1, 4});
}

TEST(CudaDispatch, EmptyAndDroppedSlots) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  check_case({5, 4, 1, 33, 0.3, -1, 5});
  check_case({37, 6, 3, 45, 0.2, 12, 6});
  check_case({64, 9, 2, 31, 0.1, 9, 7});
}

TEST(CudaDispatch, EverySlotDropped) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  // Capacity 0: R = 0, every token gets 0 (or keeps its gradient), every dweight is 0.
  check_case({4, 3, 2, 16, 0.0, 0, 8});
}

TEST(CudaDispatch, Larger) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  check_case({512, 16, 3, 320, 0.1, 80, 9});
  check_case({300, 9, 2, 1000, 0.05, -1, 10});
}

// Small powers of two, so every expected value is exact: the accumulating calls must add onto the
// buffer they are given, the others overwrite it, and a token with no rows keeps (or zeroes) it.
TEST(CudaDispatch, AccumulatesOntoExistingGradient) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  namespace cuda = moetrain::cuda;
  moetrain::Routing r;
  r.N = 3, r.E = 3, r.S = 2;
  r.selected = {0, 1, 1, -1, -1, -1};
  r.expert = r.selected;
  r.weight = {0.5f, 0.25f, 2.0f, 0.0f, 0.0f, 0.0f};
  moetrain::DispatchLayout l;
  moetrain::build_layout(l, r);
  ASSERT_EQ(l.R, 3);
  ASSERT_EQ(l.slot_row, (std::vector<int32_t>{0, 1, 2, -1, -1, -1}));
  const int64_t N = 3, S = 2, C = 2;
  const std::vector<float> y = {1, 2, 4, 8, 16, 32};  // (R, C)
  const std::vector<float> start(N * C, 100.0f);

  cuda::Context ctx;
  const cudaStream_t s = ctx.stream();
  DeviceLayout d(l);
  DeviceBuffer<float> d_y = to_device(y), dinp = to_device(start), out = to_device(start);
  uploads_done();
  cuda::permute_backward(dinp.data(), d_y.data(), d.slot_row.data(), N, S, C, true, s);
  cuda::combine_forward(out.data(), d_y.data(), d.slot_row.data(), d.row_weight.data(), N, S, C,
                        true, s);
  ctx.sync();
  EXPECT_EQ(to_host(dinp), (std::vector<float>{105, 110, 116, 132, 100, 100}));
  EXPECT_EQ(to_host(out), (std::vector<float>{101.5f, 103, 132, 164, 100, 100}));

  cuda::permute_backward(dinp.data(), d_y.data(), d.slot_row.data(), N, S, C, false, s);
  cuda::combine_forward(out.data(), d_y.data(), d.slot_row.data(), d.row_weight.data(), N, S, C,
                        false, s);
  ctx.sync();
  EXPECT_EQ(to_host(dinp), (std::vector<float>{5, 10, 16, 32, 0, 0}));
  EXPECT_EQ(to_host(out), (std::vector<float>{1.5f, 3, 32, 64, 0, 0}));
}

TEST(CudaDispatch, NoTokensLaunchesNothing) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  namespace cuda = moetrain::cuda;
  cuda::Context ctx;
  const cudaStream_t s = ctx.stream();
  cuda::permute_forward(nullptr, nullptr, nullptr, 0, 8, s);
  cuda::permute_backward(nullptr, nullptr, nullptr, 0, 2, 8, false, s);
  cuda::combine_forward(nullptr, nullptr, nullptr, nullptr, 0, 2, 8, true, s);
  cuda::combine_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 2, 8, s);
  ctx.sync();
}
