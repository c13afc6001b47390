// cuda::adamw_step against the CPU AdamW (optim/adamw.cpp): three steps from the same random start
// with the same gradients must leave bitwise the same parameters and moments, for a decay group, a
// group without decay and a buffer split into both kinds of group.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/kernels.h"
#include "optim/adamw.h"
#include "optim/optimizer.h"
#include "support/device_buffers.h"

namespace {

using namespace moetrain::testing;

using moetrain::cuda::DeviceBuffer;

// The per-step scalars as AdamW::update computes them (optim/adamw_scalars.h).
moetrain::AdamWScalars scalars_of(const moetrain::OptimizerConfig& c, float lr, int64_t step) {
  return moetrain::adamw_scalars(c.beta1, c.beta2, c.eps, c.weight_decay, lr, step);
}

// Gradients spanning several orders of magnitude (the moments then mix small and large values),
// with a few exact zeros.
std::vector<float> random_grads(std::mt19937& rng, int64_t n) {
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 2);
  std::vector<float> g(n);
  for (float& x : g) x = std::ldexp(unit(rng), exponent(rng));
  for (int64_t i = 0; i < n; i += 97) g[i] = 0.0f;
  return g;
}

// Three AdamW steps of `config` at learning rates `lrs` over n parameters tiled by `groups`, on the
// CPU and on the device (one adamw_step per group, decaying where the CPU does: the group decays
// and weight_decay ≠ 0); after each step params, exp_avg and exp_avg_sq must match bitwise.
void compare_steps(const moetrain::OptimizerConfig& config,
                   const std::vector<moetrain::ParamRange>& groups, int64_t n,
                   const std::vector<float>& lrs, uint32_t seed) {
  config.validate();
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> params(n);
  for (float& x : params) x = unit(rng);

  moetrain::AdamW cpu(config, groups, 0, n);
  std::vector<moetrain::StateBuffer> state = cpu.state();
  ASSERT_EQ(state.size(), 2u);
  ASSERT_EQ(state[0].name, "exp_avg");
  ASSERT_EQ(state[1].name, "exp_avg_sq");

  moetrain::cuda::Context ctx;
  DeviceBuffer<float> d_params = to_device(params);
  DeviceBuffer<float> d_m = to_device(std::vector<float>(n, 0.0f));
  DeviceBuffer<float> d_v = to_device(std::vector<float>(n, 0.0f));
  DeviceBuffer<float> d_grads(n);
  // The bf16 copy of the parameters (train.precision = bf16), written by every other step's pass:
  // after such a step it is bf16(params) bit for bit, parameters outside every group included.
  auto bf16_bits = [](const std::vector<float>& p) {
    std::vector<uint16_t> b;
    for (float x : p) b.push_back(moetrain::bf16(x).bits);
    return b;
  };
  DeviceBuffer<uint16_t> d_copy = to_device(bf16_bits(params));

  for (size_t k = 0; k < lrs.size(); ++k) {
    const int64_t t = static_cast<int64_t>(k) + 1;
    const std::vector<float> grads = random_grads(rng, n);
    d_grads.upload(grads.data(), n);
    // upload() copies on the legacy stream and may return before a pageable copy has landed;
    // ctx's stream does not wait for it, so the device must be idle before the step is queued.
    MOETRAIN_CUDA_CHECK(cudaDeviceSynchronize());

    cpu.step(params.data(), grads.data(), lrs[k]);
    ASSERT_EQ(cpu.step_count(), t);

    const moetrain::AdamWScalars a = scalars_of(config, lrs[k], t);
    for (const moetrain::ParamRange& g : groups) {
      const bool decay = g.weight_decay && config.weight_decay != 0.0;
      moetrain::cuda::adamw_step(d_params.data() + g.offset, d_m.data() + g.offset,
                                 d_v.data() + g.offset, d_grads.data() + g.offset, g.size, decay,
                                 a, ctx.stream(), k % 2 == 0 ? d_copy.data() + g.offset : nullptr);
    }
    ctx.sync();
    if (k % 2 == 0) {
      const std::vector<uint16_t> want = bf16_bits(params), got = to_host(d_copy);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(got[i], want[i]) << "step " << t << ": bf16 copy of parameter " << i;
    }

    const std::string at = "step " + std::to_string(t);
    expect_same_bits(to_host(d_params), params, at + " params");
    expect_same_bits(to_host(d_m), state[0].values, at + " exp_avg");
    expect_same_bits(to_host(d_v), state[1].values, at + " exp_avg_sq");
  }
}

const std::vector<float> kLrs = {3e-3f, 2e-3f, 7e-4f};

}  // namespace

TEST(CudaAdamW, DecayGroupMatchesCpuBitwise) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  const moetrain::OptimizerConfig config =
      moetrain::default_optimizer_config(moetrain::OptimizerKind::AdamW);
  ASSERT_NE(config.weight_decay, 0.0);
  for (int64_t n : {int64_t{1}, int64_t{31}, int64_t{4099}, int64_t{100003}}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    compare_steps(config, {{0, n, true}}, n, kLrs, 11);
  }
}

TEST(CudaAdamW, OtherHyperParametersMatchCpuBitwise) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  moetrain::OptimizerConfig config =
      moetrain::default_optimizer_config(moetrain::OptimizerKind::AdamW);
  config.beta1 = 0.5, config.beta2 = 0.999, config.eps = 1e-6, config.weight_decay = 0.3;
  // A large lr makes the decay factor far from 1, so a missing or doubled decay shows.
  compare_steps(config, {{0, 2053, true}}, 2053, {0.5f, 0.25f, 0.125f}, 12);
}

TEST(CudaAdamW, GroupWithoutDecayMatchesCpuBitwise) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  const moetrain::OptimizerConfig config =
      moetrain::default_optimizer_config(moetrain::OptimizerKind::AdamW);
  compare_steps(config, {{0, 4099, false}}, 4099, kLrs, 13);
}

TEST(CudaAdamW, MixedGroupsMatchCpuBitwise) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  moetrain::OptimizerConfig config =
      moetrain::default_optimizer_config(moetrain::OptimizerKind::AdamW);
  config.weight_decay = 0.2;
  // Group boundaries off any block or warp multiple; each group is its own call on offset
  // pointers, as an engine updates a buffer segment by segment.
  compare_steps(config, {{0, 1000, true}, {1000, 37, false}, {1037, 3000, true}}, 4037,
                {0.1f, 0.05f, 0.01f}, 14);
}

TEST(CudaAdamW, NoWeightDecayConfigMatchesCpuBitwise) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  moetrain::OptimizerConfig config =
      moetrain::default_optimizer_config(moetrain::OptimizerKind::AdamW);
  config.weight_decay = 0.0;
  compare_steps(config, {{0, 777, true}}, 777, kLrs, 15);
}

TEST(CudaAdamW, EmptyRangeLaunchesNothing) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  moetrain::cuda::Context ctx;
  moetrain::cuda::adamw_step(nullptr, nullptr, nullptr, nullptr, 0, true,
                             moetrain::AdamWScalars{}, ctx.stream());
  ctx.sync();
}
