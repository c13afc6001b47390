// The planner's memory as GPU trainers spend it (bf16 weights, f32 masters with the optimizer
// state, ZeRO-1/2/3, recomputation) and this trainer's on a CPU profile; element-wise work at the
// bytes the run stores; devices sized as the driver reports them.
#include <gtest/gtest.h>

#include "core/check.h"
#include "model/activation_bytes.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "support/plan_clusters.h"
#include "train/memory_estimate.h"

using namespace moetrain;
using namespace moetrain::plan;

namespace {

RunConfig bf16_run() {
  RunConfig cfg;
  cfg.model.vocab_size = 1024;
  cfg.model.dim = 512;
  cfg.model.n_layers = 4;
  cfg.model.n_heads = 8;
  cfg.model.n_kv_heads = 4;
  cfg.model.expert_hidden = 1024;
  cfg.model.n_experts = 8;
  cfg.model.top_k = 2;
  cfg.model.max_seq_len = 1024;
  cfg.train.batch_size = 2;
  cfg.train.seq_len = 1024;
  cfg.train.precision = Precision::BF16;
  return cfg;
}


}  // namespace

// An "80 GB" part holds what NVML reports: 81559 MiB (H100), 81920 MiB (A100).
TEST(PlanMemory, DevicesAreSizedAsTheDriverReportsThem) {
  EXPECT_DOUBLE_EQ(builtin_device("h100").memory_bytes, 81559.0 * 1048576);
  EXPECT_DOUBLE_EQ(builtin_device("a100").memory_bytes, 80.0 * 1073741824);
}

// On a GPU a bf16 run keeps bf16 weights, f32 gradients and f32 masters sharded with the
// optimizer state; dense state shards over the stage's 8 ranks, experts' over their 4 replicas.
// The parameter split is the planner's own count, so the figures are hand counts per stage.
TEST(PlanMemory, MixedPrecisionStateShardsByZeroStage) {
  RunConfig cfg = bf16_run();
  const ParamCounts pc = count_params(cfg.model);
  const double dense = pc.dense, expert = pc.expert / 2;  // EP 2: half the experts each
  for (int zero = 0; zero <= 3; ++zero) {
    Layout l{8, 2};  // DP 4 × EP 2
    l.zero = zero;
    const Memory m = memory_per_device(cfg, l, true);
    auto shard = [&](double n, double ranks, int from) { return zero >= from ? n / ranks : n; };
    EXPECT_DOUBLE_EQ(m.params, 2 * (shard(dense, 8, 3) + shard(expert, 4, 3))) << zero;
    EXPECT_DOUBLE_EQ(m.grads, 4 * (shard(dense, 8, 2) + shard(expert, 4, 2))) << zero;
    EXPECT_DOUBLE_EQ(m.optimizer, 12 * (shard(dense, 8, 1) + shard(expert, 4, 1))) << zero;
    EXPECT_DOUBLE_EQ(m.optimizer_without_zero, 12 * (dense + expert)) << zero;
    EXPECT_DOUBLE_EQ(m.low_precision, 0) << zero;
  }
  // dist.zero is the default; the layout's stage overrides it.
  cfg.dist.zero = 1;
  EXPECT_DOUBLE_EQ(memory_per_device(cfg, Layout{8, 2}, true).optimizer,
                   12 * (dense / 8 + expert / 4));
  // A calibrated CPU (this trainer): f32 weights and gradients and the bf16 copy of every
  // parameter, all experts included (its flat buffer), the optimizer state of its own experts.
  const Memory cpu = memory_per_device(cfg, Layout{8, 2}, false);
  EXPECT_DOUBLE_EQ(cpu.params, 4 * (dense + 2 * expert));
  EXPECT_DOUBLE_EQ(cpu.grads, 4 * (dense + 2 * expert));
  EXPECT_DOUBLE_EQ(cpu.low_precision, 2 * (dense + 2 * expert));
  EXPECT_DOUBLE_EQ(cpu.optimizer, 8 * (dense / 8 + expert / 4));
}

// Full recomputation keeps each layer's input (N·C), the MoE layers' routing, and one layer's
// activations, rows and intermediates; it pays a third more of the layers' compute and half again
// of their all-to-alls.
TEST(PlanMemory, RecomputationTradesActivationsForAForwardAgain) {
  const RunConfig cfg = bf16_run();
  const ClusterSpec c = moetrain::testing::h100_nodes(1);
  Layout keep{8, 8}, again{8, 8};
  again.recompute = Recompute::Full;
  const Prediction a = predict(cfg, c, keep, uniform_load(8));
  const Prediction b = predict(cfg, c, again, uniform_load(8));
  // A GPU keeps bf16 activations: 2 bytes for each 4 of the model's f32 count.
  const ActivationBytes none = activation_parts(cfg.model, 2, 1024, Recompute::None, DType::F32);
  const ActivationBytes full = activation_parts(cfg.model, 2, 1024, Recompute::Full, DType::F32);
  EXPECT_DOUBLE_EQ(a.memory.activations, none.total() / 2.0);
  EXPECT_DOUBLE_EQ(b.memory.activations, full.total() / 2.0);
  // Full keeps, of the blocks, each one's input (N·C f32) and its MoE layer's routing: per token
  // its K expert indices, slots and weights (3 K four-byte values), the router's probabilities and
  // logits (2 E) and one more value.
  const double N = 2 * 1024, C = 512, K = 2, E = 8, L = 4;
  EXPECT_DOUBLE_EQ(static_cast<double>(full.blocks), 4 * L * N * (C + 3 * K + 2 * E + 1));
  EXPECT_LT(b.memory.activations, a.memory.activations / 2);
  EXPECT_NEAR(b.parts.attention, a.parts.attention * 4 / 3, 1e-12);
  EXPECT_NEAR(b.parts.experts, a.parts.experts * 4 / 3, 1e-12);
  EXPECT_NEAR(b.parts.a2a, a.parts.a2a * 1.5, 1e-12);
  EXPECT_DOUBLE_EQ(b.parts.lm_head, a.parts.lm_head);
  EXPECT_GT(b.step_time_s, a.step_time_s);
}

// Selective recomputation (--recompute-modules layernorm,moe_act), by hand on bf16_run() at
// EP 8 on H100 (bf16 activations, 2 bytes an element; N = 2 · 1024 tokens, C = 512, K = 2,
// F = 1024, 4 MoE blocks, one expert a rank, uniform load):
//   layernorm drops each block's two norm outputs: 2 · N · C · 2 bytes = 4 MiB a block, 16 MiB;
//     it runs the two norms' forwards again, each reading and writing N · C: 2 · 2 · 2 · N · C
//     = 8 MiB a block at the memory bandwidth (the built-in H100 has no norm rate of its own).
//   moe_act drops the routed experts' activation outputs g, N · K rows of F: 2 · N · K · F · 2
//     bytes = 8 MiB a block, 32 MiB; it runs the activation again, reading a and b and writing
//     g over the rank's N · K rows (at uniform load each rank gets as many as it sends): 3 · 2 ·
//     N · K · F = 24 MiB a block.
TEST(PlanMemory, SelectiveRecomputationDropsNormsAndExpertActivations) {
  const RunConfig cfg = bf16_run();
  const ClusterSpec c = moetrain::testing::h100_nodes(1);
  const double MiB = 1048576, L = 4, bw = c.device.memory_bandwidth;
  Layout keep{8, 8}, norms{8, 8}, acts{8, 8}, both{8, 8};
  norms.recompute_modules = {.layernorm = true};
  acts.recompute_modules = {.moe_act = true};
  both.recompute_modules = {.layernorm = true, .moe_act = true};
  const Prediction a = predict(cfg, c, keep, uniform_load(8));
  const Prediction n = predict(cfg, c, norms, uniform_load(8));
  const Prediction g = predict(cfg, c, acts, uniform_load(8));
  const Prediction ng = predict(cfg, c, both, uniform_load(8));
  EXPECT_DOUBLE_EQ(a.memory.activations - n.memory.activations, L * 4 * MiB);
  EXPECT_DOUBLE_EQ(a.memory.activations - g.memory.activations, L * 8 * MiB);
  EXPECT_DOUBLE_EQ(a.memory.activations - ng.memory.activations, L * 12 * MiB);
  EXPECT_DOUBLE_EQ(ng.memory.params + ng.memory.grads + ng.memory.optimizer,
                   a.memory.params + a.memory.grads + a.memory.optimizer);
  // Time: relative 1e-12 for the sums' rounding (step parts of about a millisecond).
  auto near = [](double got, double want) { EXPECT_NEAR(got, want, 1e-12 * want + 1e-18); };
  near(n.parts.norms - a.parts.norms, L * 8 * MiB / bw);
  near(n.parts.experts - a.parts.experts, 0);
  near(g.parts.experts - a.parts.experts, L * 24 * MiB / bw);
  near(g.parts.experts_mean - a.parts.experts_mean, L * 24 * MiB / bw);
  near(g.parts.norms - a.parts.norms, 0);
  near(ng.parts.norms + ng.parts.experts - a.parts.norms - a.parts.experts, L * 32 * MiB / bw);
  EXPECT_DOUBLE_EQ(ng.parts.attention, a.parts.attention);
  EXPECT_DOUBLE_EQ(ng.parts.a2a, a.parts.a2a);
  EXPECT_GT(ng.step_time_s, a.step_time_s);
  // Less than moe recomputation costs (the up-projections' GEMMs again), more memory than it.
  Layout moe{8, 8};
  moe.recompute = Recompute::Moe;
  const Prediction m = predict(cfg, c, moe, uniform_load(8));
  EXPECT_LT(ng.step_time_s, m.step_time_s);
  // The engine has no such mode: the layout is the planner's only, and says so.
  EXPECT_TRUE(a.trainer_runs()) << a.planner_only;
  EXPECT_FALSE(ng.trainer_runs());
  EXPECT_EQ(ng.planner_only,
            "planner only: moetrain train has no selective recomputation (layernorm,moe_act) yet");
}

// The modules are named as Megatron-Core names them; anything else is refused naming the value
// and the allowed names, and they add to none or moe only.
TEST(PlanMemory, SelectiveRecomputationModulesAreChecked) {
  EXPECT_FALSE(parse_recompute_modules("").any());
  const RecomputeModules both = parse_recompute_modules("moe_act,layernorm");
  EXPECT_TRUE(both.layernorm && both.moe_act);
  EXPECT_EQ(recompute_modules_name(both), "layernorm,moe_act");
  EXPECT_EQ(recompute_modules_name(parse_recompute_modules("moe_act")), "moe_act");
  try {
    parse_recompute_modules("layernorm,core_attn");
    ADD_FAILURE() << "core_attn accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--recompute-modules layernorm,core_attn: 'core_attn' "
                                         "is not a module; allowed are layernorm, moe_act"),
              std::string::npos)
        << e.what();
  }
  RunConfig cfg = bf16_run();
  const ClusterSpec c = moetrain::testing::h100_nodes(1);
  Layout l{8, 8};
  l.recompute_modules = {.layernorm = true, .moe_act = true};
  EXPECT_EQ(layout_problem(cfg, c, l), "");
  l.recompute = Recompute::Full;
  EXPECT_NE(layout_problem(cfg, c, l).find("--recompute-modules layernorm,moe_act with "
                                           "recomputation full"),
            std::string::npos);
  l.recompute = Recompute::Moe;
  EXPECT_NE(layout_problem(cfg, c, l).find("moe_act is for none"), std::string::npos);
  l.recompute_modules = {.layernorm = true};
  EXPECT_EQ(layout_problem(cfg, c, l), "");
  // The config's train.recompute counts where the layout leaves it unset.
  l.recompute.reset();
  l.recompute_modules = {.moe_act = true};
  cfg.train.recompute = Recompute::Moe;
  EXPECT_NE(layout_problem(cfg, c, l), "");
}

// Offloaded optimizer state (--offload): the device bytes lose the optimizer state (moments and
// master weights) and gain the store's ring (3 chunks of 1 Mi f32 elements per moment); without a
// disk bandwidth in the cluster file the phase is timed as in memory, with one it takes at least
// the state's read and write at the node's share of the disk.
TEST(PlanMemory, OffloadMovesTheStateToADiskAndTimesIt) {
  const RunConfig cfg = bf16_run();
  ClusterSpec c = moetrain::testing::h100_nodes(1);
  Layout mem{8, 8}, off{8, 8};
  off.offload = true;
  const Prediction a = predict(cfg, c, mem, uniform_load(8));
  const Prediction b = predict(cfg, c, off, uniform_load(8));
  EXPECT_GT(a.memory.optimizer, 0);
  EXPECT_EQ(b.memory.optimizer, 0);
  EXPECT_DOUBLE_EQ(b.memory.buffers - a.memory.buffers, 3.0 * 2 * (1 << 20) * 4);
  EXPECT_DOUBLE_EQ(b.parts.optimizer, a.parts.optimizer);
  c.disk_bandwidth = 1e9;
  const Prediction d = predict(cfg, c, off, uniform_load(8));
  // ZeRO 0: each process updates every dense parameter and its 1/8 of the experts, reading and
  // writing 2 moments of 4 bytes each, 8 processes of the node sharing 1 GB/s.
  const ParamCounts pc = count_params(cfg.model);
  const double disk_s = 2 * 4 * 2 * (pc.dense + pc.expert / 8) * 8 / 1e9;
  EXPECT_GT(disk_s, a.parts.optimizer);
  EXPECT_DOUBLE_EQ(d.parts.optimizer, disk_s);
  EXPECT_GT(d.step_time_s, b.step_time_s);
  EXPECT_DOUBLE_EQ(predict(cfg, c, mem, uniform_load(8)).parts.optimizer, a.parts.optimizer);
}

// Element-wise work (norms, residual adds, dispatch and combine copies) streams bf16 on a GPU
// in a bf16 run: half the f32 run's bytes. A calibrated CPU keeps this trainer's f32.
TEST(PlanMemory, ElementWiseWorkMovesTheRunsPrecisionBytes) {
  RunConfig bf = bf16_run(), f32 = bf16_run();
  f32.train.precision = Precision::F32;
  const ClusterSpec gpu = moetrain::testing::h100_nodes(1);
  const Prediction pb = predict(bf, gpu, Layout{8, 8}, uniform_load(8));
  const Prediction pf = predict(f32, gpu, Layout{8, 8}, uniform_load(8));
  EXPECT_NEAR(pb.parts.norms, pf.parts.norms / 2, 1e-15);
  EXPECT_DOUBLE_EQ(activation_bytes(bf, true), 2);
  EXPECT_DOUBLE_EQ(activation_bytes(bf, false), 4);
  EXPECT_DOUBLE_EQ(activation_bytes(f32, true), 4);
}

// ZeRO-3 all-gathers the weights before forward and backward: a collective per kind more.
TEST(PlanMemory, ZeroThreeGathersTheWeights) {
  const RunConfig cfg = bf16_run();
  const ClusterSpec c = moetrain::testing::h100_nodes(2);
  Layout one{16, 8}, three{16, 8};
  one.zero = 1;
  three.zero = 3;
  const Prediction a = predict(cfg, c, one, uniform_load(8));
  const Prediction b = predict(cfg, c, three, uniform_load(8));
  EXPECT_EQ(b.comm.reductions.size(), a.comm.reductions.size() + 2);
  EXPECT_GT(b.parts.grad_sync, a.parts.grad_sync);
  EXPECT_LT(b.memory.total(), a.memory.total());
  EXPECT_NE(b.comm.reductions.back().first.find("ZeRO-3"), std::string::npos);
}
