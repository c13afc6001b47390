// The planner's formulas against hand counts, and its refusals of bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>

#include "core/check.h"
#include "model/params.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "plan/load_model.h"
#include "support/expect_error.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::plan;
using moetrain::testing::error_of;

namespace {

ModelConfig tiny_shape() {
  ModelConfig m;
  m.vocab_size = 16;
  m.dim = 8;
  m.n_layers = 1;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.expert_hidden = 4;
  m.n_experts = 4;
  m.top_k = 2;
  m.max_seq_len = 4;
  return m;
}

ClusterSpec gpu_cluster(int64_t per_node, int64_t nodes) {
  ClusterSpec c;
  c.device = builtin_device("h100");
  c.devices_per_node = per_node;
  c.nodes = nodes;
  c.intra_node_bandwidth = 450e9;
  c.inter_node_bandwidth = 400e9;
  c.intra_node_latency = 3e-6;
  c.inter_node_latency = 10e-6;
  return c;
}

RunConfig small_run() {
  RunConfig cfg;
  cfg.model.vocab_size = 256;
  cfg.model.dim = 256;
  cfg.model.n_layers = 2;
  cfg.model.n_heads = 4;
  cfg.model.n_kv_heads = 2;
  cfg.model.expert_hidden = 512;
  cfg.model.n_experts = 8;
  cfg.model.top_k = 2;
  cfg.train.batch_size = 8;
  cfg.train.seq_len = 256;
  cfg.model.max_seq_len = 256;
  return cfg;
}

}  // namespace

// Hand count, B = 1, T = 4, C = 8, NH = 2, NKV = 1 (HS = 4), F = 4, E = 4, K = 2, V = 16.
TEST(PlanFormulas, ForwardFlopsMatchAHandCount) {
  const ForwardFlops f = forward_flops(tiny_shape(), 1, 4);
  // Q (8→8) and O (8→8): 2·4·8·8 = 512 each; K and V (8→4): 256 each.
  EXPECT_DOUBLE_EQ(f.attention_proj, 512 + 512 + 256 + 256);
  // 10 causal (query, key) pairs per head, 2 heads, q·k and p·v of 4 multiply-adds each.
  EXPECT_DOUBLE_EQ(f.attention_scores, 10 * 2 * 2 * (2 * 4));
  EXPECT_DOUBLE_EQ(f.router, 2 * 4 * 8 * 4);
  // 4 tokens × 2 experts, each w1, w3 (8→4) and w2 (4→8): 3 · 2·8·4 FLOPs.
  EXPECT_DOUBLE_EQ(f.experts, 4 * 2 * 3 * (2 * 8 * 4));
  EXPECT_DOUBLE_EQ(f.lm_head, 2 * 4 * 8 * 16);
  EXPECT_DOUBLE_EQ(f.shared, 0);
}

TEST(PlanFormulas, RingAllReduceSendsTwiceTheShareOfTheOthers) {
  EXPECT_DOUBLE_EQ(ring_allreduce_bytes(100, 4), 150);
  EXPECT_DOUBLE_EQ(ring_allreduce_bytes(100, 2), 100);
  EXPECT_DOUBLE_EQ(ring_allreduce_bytes(100, 1), 0);
}

// Two nodes of four devices: device links of 100 GB/s and 2 µs, a node link of 40 GB/s (10 GB/s
// for each of its four ranks) and 5 µs. Each of 8 ranks sends 7 MB (1 MB to each other rank).
TEST(PlanFormulas, AllToAllFlatAndHierarchicalMatchAHandCount) {
  ClusterSpec c = gpu_cluster(4, 2);
  c.intra_node_bandwidth = 100e9, c.inter_node_bandwidth = 40e9;
  c.intra_node_latency = 2e-6, c.inter_node_latency = 5e-6;
  // Flat: 3 MB to the node's 3 others and 4 MB to the other node's 4 at once; 3 + 4 messages.
  const Collective flat = alltoall(c, 7e6, 8, false);
  EXPECT_EQ(flat.kind, "flat");
  ASSERT_EQ(flat.phases.size(), 2u);
  EXPECT_DOUBLE_EQ(flat.phases[0].bytes, 3e6);
  EXPECT_DOUBLE_EQ(flat.phases[1].bytes, 4e6);
  EXPECT_DOUBLE_EQ(flat.phases[1].sharing, 4);
  EXPECT_NEAR(flat.seconds(), 3 * 2e-6 + 4 * 5e-6 + std::max(3e6 / 100e9, 4e6 / 10e9), 1e-15);
  // 2-D: all 8 MB of rows (the own share included) regrouped within the node (6 MB leave the
  // rank), then the 4 MB bound for the other node in one message.
  const Collective hier = alltoall(c, 7e6, 8, true);
  EXPECT_EQ(hier.kind, "hierarchical");
  ASSERT_EQ(hier.phases.size(), 2u);
  EXPECT_NEAR(hier.seconds(), (3 * 2e-6 + 6e6 / 100e9) + (1 * 5e-6 + 4e6 / 10e9), 1e-15);
  // A group inside one node has no second phase: flat, whatever was asked.
  EXPECT_EQ(alltoall(c, 3e6, 4, true).kind, "flat");
  EXPECT_EQ(alltoall(c, 3e6, 4, true).phases.size(), 1u);
  EXPECT_EQ(alltoall(c, 3e6, 1, false).kind, "none");
  const Collective ring = ring_allreduce(c, 8e6, 8, true);
  EXPECT_NEAR(ring.seconds(), 14 * 5e-6 + 14e6 / 40e9, 1e-15);
}

// The written-out communication is the step's: its exchanges and reductions add up to the parts
// (a skewed load makes the layers' exchanges differ; the model is linear in their bytes).
TEST(PlanModel, CommunicationWrittenOutAddsUpToTheStepsParts) {
  RunConfig cfg = small_run();
  cfg.train.grad_accum = 3;
  const ClusterSpec c = gpu_cluster(4, 8);
  for (const bool hierarchical : {false, true}) {
    cfg.dist.hierarchical = hierarchical;
    // 32 devices: tensor shards of 2, EP groups of 8 (folded over TP × DP) over two nodes, 4
    // replicas of each expert.
    const Prediction p = predict(cfg, c, {32, 8, 2, 1, 1}, zipf_load(8, 1.2));
    const CommBreakdown& m = p.comm;
    EXPECT_EQ(m.a2a_runs, hierarchical ? "hierarchical" : "flat");
    EXPECT_DOUBLE_EQ(m.a2a_exchanges, 4 * cfg.model.n_moe_layers() * 3);
    EXPECT_GT(m.a2a_hot_recv_bytes, m.a2a_send_bytes);  // zipf: the hot rank receives more
    const Collective& run = hierarchical ? m.a2a_hierarchical : m.a2a_flat;
    EXPECT_NEAR(m.a2a_exchanges * (run.seconds() + m.a2a_late_s), p.parts.a2a,
                1e-9 * p.parts.a2a);
    double reductions = 0;
    for (const auto& [name, r] : m.reductions) reductions += r.seconds();
    EXPECT_NEAR(reductions, p.parts.grad_sync, 1e-12 * p.parts.grad_sync);
    ASSERT_EQ(m.reductions.size(), 2u);
    EXPECT_EQ(m.reductions[0].first, "dense gradients over 16 ranks");
    EXPECT_EQ(m.reductions[1].first, "expert gradients over 4 ranks");
    for (const auto& [name, r] : m.reductions) EXPECT_GT(r.seconds(), 0) << name;
    EXPECT_DOUBLE_EQ(m.tp_count * m.tensor_parallel.seconds(), p.parts.tensor_parallel);
    EXPECT_GT(m.tp_count, 0);
  }
}

TEST(PlanFormulas, MemoryWithAndWithoutZero1) {
  RunConfig cfg = small_run();
  double dense = 0, expert = 0;
  const ParamLayout layout(cfg.model);
  for (const auto& p : layout.params()) (p.expert >= 0 ? expert : dense) += p.numel;
  const Layout l{8, 2};  // DP 4 × EP 2
  const Memory plain = memory_per_device(cfg, l);
  // This trainer's flat buffer holds every expert's weights and gradients; its optimizer steps
  // its own half of them.
  EXPECT_DOUBLE_EQ(plain.params, 4 * (dense + expert));
  EXPECT_DOUBLE_EQ(plain.grads, plain.params);
  EXPECT_DOUBLE_EQ(plain.optimizer, 2 * 4 * (dense + expert / 2));  // AdamW: m and v
  EXPECT_DOUBLE_EQ(plain.low_precision, 0);
  cfg.dist.zero = 1;
  const Memory zero = memory_per_device(cfg, l);
  EXPECT_DOUBLE_EQ(zero.optimizer, 2 * 4 * (dense / 8 + expert / (2 * 4)));
  EXPECT_DOUBLE_EQ(zero.optimizer_without_zero, plain.optimizer);
  cfg.train.precision = Precision::BF16;
  EXPECT_DOUBLE_EQ(memory_per_device(cfg, l).low_precision, 2 * (dense + expert));
}

// The window a bucketed reduction hides behind: two thirds of the slowest rank's compute, its
// experts once (the balanced figure is not compute), the optimizer (after the reduction) not.
TEST(PlanFormulas, OverlapWindowCountsTheSlowestRankOnce) {
  StepParts s;
  s.attention = 3;
  s.experts = 6;       // the slowest rank
  s.experts_mean = 3;  // perfect balance: not part of the step
  s.optimizer = 1.5;
  EXPECT_DOUBLE_EQ(backward_window(s), 2.0 / 3.0 * 9);
  // 4 buckets of 2.5 s behind a 6 s window: 4 s outlast it.
  EXPECT_DOUBLE_EQ(overlap_exposed(10, 4, 6), 4);
  // A short reduction still waits for its last bucket, ready when backward ends.
  EXPECT_DOUBLE_EQ(overlap_exposed(2, 4, 6), 0.5);
  EXPECT_DOUBLE_EQ(overlap_exposed(2, 0, 6), 2);  // one bucket at least
  EXPECT_DOUBLE_EQ(overlap_exposed(0, 4, 6), 0);
}

// Through the model: with overlap, the exposed reduction is overlap_exposed of the total behind
// the step's own backward window.
TEST(PlanModel, OverlappedReductionIsExposedBeyondTheBackwardWindow) {
  RunConfig cfg = small_run();
  cfg.dist.overlap = true;
  const ClusterSpec c = gpu_cluster(8, 4);
  const Prediction p = predict(cfg, c, Layout{32, 2}, zipf_load(8, 1.0));
  ASSERT_GT(p.parts.grad_sync, 0);
  ASSERT_GT(p.parts.experts, p.parts.experts_mean);
  const double window = backward_window(p.parts);
  EXPECT_GE(p.parts.grad_sync_exposed, p.parts.grad_sync - window - 1e-15);
  EXPECT_LE(p.parts.grad_sync_exposed, p.parts.grad_sync);
  // Buckets of a byte: nothing but what outlasts the window; over a slow network the
  // reduction outlasts it by its total less the window, exactly.
  cfg.dist.bucket_mb = 1.0 / 1048576;
  const Prediction fine = predict(cfg, c, Layout{32, 2}, zipf_load(8, 1.0));
  EXPECT_LT(fine.parts.grad_sync, backward_window(fine.parts));
  EXPECT_NEAR(fine.parts.grad_sync_exposed, 0, 1e-6 * fine.parts.grad_sync);
  ClusterSpec slow = c;
  slow.inter_node_bandwidth = 1e7;
  const Prediction late = predict(cfg, slow, Layout{32, 2}, zipf_load(8, 1.0));
  ASSERT_GT(late.parts.grad_sync, backward_window(late.parts));
  EXPECT_NEAR(late.parts.grad_sync_exposed,
              late.parts.grad_sync - backward_window(late.parts), 1e-9 * late.parts.grad_sync);
  // One bucket: all of it, ready only when backward ends.
  cfg.dist.bucket_mb = 1e9;
  const Prediction one = predict(cfg, c, Layout{32, 2}, zipf_load(8, 1.0));
  EXPECT_DOUBLE_EQ(one.parts.grad_sync_exposed, one.parts.grad_sync);
  cfg.dist.overlap = false;
  EXPECT_DOUBLE_EQ(predict(cfg, c, Layout{32, 2}, zipf_load(8, 1.0)).parts.grad_sync_exposed,
                   p.parts.grad_sync);
}

TEST(PlanModel, SkewedLoadSlowsTheStepAndTheHotRankSetsIt) {
  const RunConfig cfg = small_run();
  const ClusterSpec c = gpu_cluster(8, 1);
  const Prediction even = predict(cfg, c, {8, 4}, uniform_load(8));
  const Prediction skew = predict(cfg, c, {8, 4}, zipf_load(8, 1.2));
  EXPECT_NEAR(even.imbalance, 1.0, 1e-9);
  EXPECT_GT(skew.imbalance, 1.5);
  EXPECT_GT(skew.parts.experts, 1.3 * skew.parts.experts_mean);
  EXPECT_GT(skew.step_time_s, even.step_time_s);
  EXPECT_GT(skew.parts.a2a, even.parts.a2a);  // the hot rank receives more rows
}

TEST(PlanModel, HierarchicalAllToAllPaysFewerInterNodeLatencies) {
  RunConfig cfg = small_run();
  cfg.train.batch_size = 1;
  cfg.train.seq_len = 8;  // tiny messages: latency-bound
  ClusterSpec c = gpu_cluster(4, 4);
  c.inter_node_latency = 1e-3;
  const Prediction flat = predict(cfg, c, {16, 8}, uniform_load(8));
  cfg.dist.hierarchical = true;
  const Prediction hier = predict(cfg, c, {16, 8}, uniform_load(8));
  EXPECT_EQ(flat.a2a_kind, "flat");
  EXPECT_EQ(hier.a2a_kind, "hierarchical");
  // flat: 4 off-node peers per all-to-all; 2-D: 1 (two nodes per group of 8).
  EXPECT_LT(hier.parts.a2a, 0.5 * flat.parts.a2a);
}

TEST(PlanModel, ChunkedAllToAllHidesBehindExperts) {
  RunConfig cfg = small_run();
  const ClusterSpec c = gpu_cluster(8, 1);
  const Prediction one = predict(cfg, c, {8, 8}, uniform_load(8));
  cfg.dist.a2a_chunks = 4;
  const Prediction four = predict(cfg, c, {8, 8}, uniform_load(8));
  EXPECT_DOUBLE_EQ(one.parts.a2a_exposed, one.parts.a2a);
  EXPECT_NEAR(four.parts.a2a_exposed,
              four.parts.a2a - 0.75 * std::min(four.parts.a2a, four.parts.experts), 1e-12);
  EXPECT_LT(four.step_time_s, one.step_time_s);
}

TEST(PlanBadInput, LayoutThatDoesNotDivide) {
  const RunConfig cfg = small_run();
  const ClusterSpec c = gpu_cluster(8, 2);
  EXPECT_NE(error_of([&] { predict(cfg, c, {6, 4}, uniform_load(8)); }).find("dist.ep = 4"),
            std::string::npos);
  EXPECT_NE(error_of([&] { predict(cfg, c, {6, 3}, uniform_load(8)); }).find("model.n_experts"),
            std::string::npos);
  EXPECT_NE(error_of([&] { predict(cfg, c, {32, 8}, uniform_load(8)); }).find("16 devices"),
            std::string::npos);
}

TEST(PlanBadInput, ModelThatDoesNotFitSaysWhatItNeeds) {
  RunConfig cfg = small_run();
  cfg.model.dim = 4096;
  cfg.model.expert_hidden = 14336;
  cfg.model.n_layers = 32;
  cfg.model.n_heads = 32;
  cfg.model.n_kv_heads = 8;
  cfg.model.vocab_size = 32000;
  cfg.model.max_seq_len = 4096;
  ClusterSpec c = gpu_cluster(8, 1);
  const Prediction p = predict(cfg, c, {8, 8}, uniform_load(8));
  EXPECT_FALSE(p.fits);
  const std::string e = error_of([&] { check_fits(p, c); });
  EXPECT_NE(e.find("does not fit"), std::string::npos) << e;
  EXPECT_NE(e.find("GiB per device"), std::string::npos) << e;
  EXPECT_NE(e.find("device.memory_bytes"), std::string::npos) << e;
}

TEST(PlanBadInput, ClusterFileKeysAreNamed) {
  moetrain::testing::TempDir tmp("plan_cluster");
  const std::string good =
      "[cluster]\ndevice = \"a100\"\ndevices_per_node = 8\nnodes = 4\n"
      "intra_node_bandwidth = 300e9\ninter_node_bandwidth = 200e9\n"
      "intra_node_latency = 3e-6\ninter_node_latency = 5e-6\n";
  auto write = [&](const std::string& text) {
    const auto path = (tmp.path() / "c.toml").string();
    std::ofstream(path) << text;
    return path;
  };
  const ClusterSpec c = load_cluster(write(good), "");
  EXPECT_EQ(c.devices(), 32);
  EXPECT_DOUBLE_EQ(c.device.peak_flops_bf16, 312e12);
  auto without = [&](const std::string& key) {
    std::string t = good;
    const auto at = t.find(key);
    t.erase(at, t.find('\n', at) - at + 1);
    return t;
  };
  std::string e = error_of([&] { load_cluster(write(without("inter_node_bandwidth")), ""); });
  EXPECT_NE(e.find("cluster.inter_node_bandwidth is missing"), std::string::npos) << e;
  std::string zero = good;
  zero.replace(zero.find("nodes = 4"), 9, "nodes = 0");
  e = error_of([&] { load_cluster(write(zero), ""); });
  EXPECT_NE(e.find("cluster.nodes = 0: must be a whole number in [1, 16777216]"), std::string::npos)
      << e;
  // An integer beyond what a double holds exactly (toml++ gives no double for it) is still named
  // with its value and the range, not as "not a number".
  std::string huge = good;
  huge.replace(huge.find("nodes = 4"), 9, "nodes = 9223372036854775807");
  e = error_of([&] { load_cluster(write(huge), ""); });
  EXPECT_NE(e.find("cluster.nodes = 9223372036854775807: must be a whole number in [1, 16777216]"),
            std::string::npos)
      << e;
  huge = good;
  huge.replace(huge.find("intra_node_latency = 3e-6"), 25, "intra_node_latency = 9007199254740993");
  EXPECT_DOUBLE_EQ(load_cluster(write(huge), "").intra_node_latency, 9007199254740992.0);
  e = error_of([&] { load_cluster(write(without("device = ")), ""); });
  EXPECT_NE(e.find("--profile"), std::string::npos) << e;
  e = error_of([&] { builtin_device("v100"); });
  EXPECT_NE(e.find("allowed are a100, h100"), std::string::npos) << e;
  e = error_of([&] { parse_load("zipf:x", 8); });
  EXPECT_NE(e.find("zipf:S"), std::string::npos) << e;
}
