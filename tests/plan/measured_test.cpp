// The planner's use of what a calibration measured at a config's own shapes (plan/kernel_table.h)
// and of the collectives measured under MPI (plan/calibrate_comm.h): hand-made profiles, pure
// arithmetic, and the profile file's round trip and its errors.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "core/check.h"
#include "model/params.h"
#include "plan/calibrate.h"
#include "plan/calibrate_comm.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "plan/kernel_table.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::plan;

namespace {

RunConfig tiny() {
  RunConfig cfg;
  cfg.model.vocab_size = 256;
  cfg.model.dim = 128;
  cfg.model.n_layers = 2;
  cfg.model.n_heads = 4;
  cfg.model.n_kv_heads = 2;
  cfg.model.expert_hidden = 256;
  cfg.model.n_experts = 8;
  cfg.model.top_k = 2;
  cfg.model.max_seq_len = 128;
  cfg.train.batch_size = 8;
  cfg.train.seq_len = 128;
  return cfg;
}

DeviceModel cpu(int64_t threads) {
  DeviceModel d;
  d.peak_flops_f32 = 100e9;
  d.memory_bytes = 8e9;
  d.memory_bandwidth = 20e9;
  d.threads = threads;
  d.gemm_f32_dims = {32, 1024};
  d.gemm_f32_flops = {50e9, 100e9};
  d.attention_flops = 20e9;
  return d;
}

ClusterSpec one_process(const DeviceModel& d) {
  ClusterSpec c;
  c.device = d;
  c.intra_node_bandwidth = c.inter_node_bandwidth = 5e9;
  c.intra_node_latency = c.inter_node_latency = 3e-6;
  return c;
}

}  // namespace

TEST(PlanMeasured, ExpertsInterpolateSecondsPerRowInLogRows) {
  KernelTable k;
  k.add("experts", {128, 256, 64, 1}, 64e-6);    // 1 µs a row
  k.add("experts", {128, 256, 256, 1}, 128e-6);  // 0.5 µs a row
  EXPECT_DOUBLE_EQ(*k.experts(128, 256, 64, 1), 64e-6);
  EXPECT_DOUBLE_EQ(*k.experts(128, 256, 256, 1), 128e-6);
  // Halfway in log rows: 0.75 µs a row.
  EXPECT_NEAR(*k.experts(128, 256, 128, 1), 128 * 0.75e-6, 1e-12);
  // Past the ends: the nearest measured rate per row.
  EXPECT_DOUBLE_EQ(*k.experts(128, 256, 16, 1), 16e-6);
  EXPECT_DOUBLE_EQ(*k.experts(128, 256, 1024, 1), 512e-6);
  EXPECT_DOUBLE_EQ(*k.experts(128, 256, 0, 1), 0);
  // Another shape or precision was not measured.
  EXPECT_FALSE(k.experts(128, 512, 64, 1).has_value());
  EXPECT_FALSE(k.experts(128, 256, 64, 2).has_value());
}

TEST(PlanMeasured, TimedLayersReplaceTheCurves) {
  const RunConfig cfg = tiny();
  const LoadModel load = uniform_load(8);
  const DeviceModel plain = cpu(2);
  // The attention projections Q and O (1024 tokens, 128 → 128) and the attention core timed:
  // each step of the timed figures moves the prediction by exactly that much per layer.
  auto with = [&](double linear_s, double attention_s) {
    DeviceModel d = plain;
    d.kernels.add("linear", {1024, 128, 128, 1}, linear_s);
    d.kernels.add("attention", {8, 128, 4, 2, 32}, attention_s);
    return predict(cfg, one_process(d), {}, load);
  };
  const Prediction a = with(1e-3, 2e-3), b = with(2e-3, 2e-3), c = with(1e-3, 5e-3);
  EXPECT_NEAR(b.parts.attention - a.parts.attention, 2 * 2 * 1e-3, 1e-12);  // Q, O × 2 layers
  EXPECT_NEAR(c.parts.attention - a.parts.attention, 2 * 3e-3, 1e-12);
  // A shape not timed (other tokens) keeps the curves.
  RunConfig other = cfg;
  other.train.batch_size = 4;
  DeviceModel d = plain;
  d.kernels.add("linear", {1024, 128, 128, 1}, 1.0);
  EXPECT_DOUBLE_EQ(predict(other, one_process(d), {}, load).parts.attention,
                   predict(other, one_process(plain), {}, load).parts.attention);
  // Everything else is unchanged.
  const Prediction before = predict(cfg, one_process(plain), {}, load);
  EXPECT_DOUBLE_EQ(a.parts.experts, before.parts.experts);
  EXPECT_DOUBLE_EQ(a.parts.norms, before.parts.norms);
}

TEST(PlanMeasured, ExpertsUseTheirTimedKernelPerSourceRank) {
  RunConfig cfg = tiny();
  const LoadModel load = uniform_load(8);
  DeviceModel d = cpu(1);
  d.kernels.add("experts", {128, 256, 128, 1}, 100e-6);
  d.kernels.add("experts", {128, 256, 256, 1}, 150e-6);
  ClusterSpec c = one_process(d);
  c.devices_per_node = 2;
  // One process: 8 experts of N·K/E = 256 rows a layer, one call each: 150 µs × 8 × 2 layers.
  EXPECT_NEAR(predict(cfg, one_process(d), {}, load).parts.experts, 8 * 2 * 150e-6, 1e-12);
  // EP 2: 4 experts, each 512 rows arriving as 2 calls of 256 (one per source rank).
  EXPECT_NEAR(predict(cfg, c, {.procs = 2, .ep = 2}, load).parts.experts, 4 * 2 * 2 * 150e-6,
              1e-12);
  // Batch 4 under EP 2: 256 rows an expert as 2 calls of 128.
  cfg.train.batch_size = 4;
  EXPECT_NEAR(predict(cfg, c, {.procs = 2, .ep = 2}, load).parts.experts, 4 * 2 * 2 * 100e-6,
              1e-12);
}

TEST(PlanMeasured, TimedUpdateSetsTheOptimizer) {
  const RunConfig cfg = tiny();
  DeviceModel d = cpu(2);
  d.kernels.add("optimizer", {1e6, optimizer_code("adamw")}, 2e-3);  // 2 ns a parameter
  const Prediction p = predict(cfg, one_process(d), {}, uniform_load(8));
  const Prediction sgd_cfg = [&] {
    RunConfig s = cfg;
    s.optim.name = "sgd";
    return predict(s, one_process(d), {}, uniform_load(8));
  }();
  const ParamLayout layout(cfg.model);
  EXPECT_NEAR(p.parts.optimizer, 2e-9 * static_cast<double>(layout.size()), 1e-12);
  // Another optimizer was not timed: the bytes it moves at the memory's rate.
  EXPECT_NE(sgd_cfg.parts.optimizer, p.parts.optimizer);
}

TEST(PlanMeasured, ProcessesFillingTheCoresHideNoCommunication) {
  RunConfig cfg = tiny();
  cfg.dist.overlap = true;
  cfg.dist.a2a_chunks = 2;
  ClusterSpec c = one_process(cpu(1));
  c.devices_per_node = 2;
  const Prediction hidden = predict(cfg, c, {.procs = 2, .ep = 2}, uniform_load(8));
  EXPECT_LT(hidden.parts.a2a_exposed, hidden.parts.a2a);
  c.comm_shares_cores = true;
  const Prediction shared = predict(cfg, c, {.procs = 2, .ep = 2}, uniform_load(8));
  EXPECT_DOUBLE_EQ(shared.parts.a2a_exposed, shared.parts.a2a);
  EXPECT_DOUBLE_EQ(shared.parts.grad_sync_exposed, shared.parts.grad_sync);
  // The step waits for the small collectives: 2 layers × (2 statistics + routing counts), the
  // update's 2 and the metrics', each a latency.
  EXPECT_GT(shared.parts.sync, 0);
  EXPECT_NEAR(shared.parts.sync / c.intra_node_latency, 2 * 3 + 2 + 6, 1e-9);
  EXPECT_DOUBLE_EQ(predict(cfg, one_process(cpu(2)), {}, uniform_load(8)).parts.sync, 0);
  // A late peer's measured cost at each of the 4 exchanges of each of the 2 MoE layers.
  c.late_penalty = 1e-4;
  EXPECT_NEAR(predict(cfg, c, {.procs = 2, .ep = 2}, uniform_load(8)).parts.a2a - shared.parts.a2a,
              2 * 4 * 1e-4, 1e-12);
}

TEST(PlanMeasured, ProfileKeepsKernelsAndCollectives) {
  moetrain::testing::TempDir tmp("plan_measured");
  DeviceModel all = cpu(2), one = cpu(1);
  all.kernels.add("linear", {1024, 128, 128, 1}, 1e-3);
  all.kernels.add("experts", {128, 256, 256, 1}, 2e-4);
  one.kernels.add("linear", {1024, 128, 128, 1}, 1.5e-3);
  const std::string profile = (tmp.path() / "p.toml").string();
  save_profile(all, one, 5e9, 3e-6,
               {CommFigures{2, 6e-6, 3e9, 2e9, 0, 0.25, 4e9, {}, {}},
                CommFigures{4, 40e-6, 2e9, 1.5e9, 3e-4, 1, 0, {}, {}}},
               profile);
  const ClusterSpec c1 = local_cluster(profile, 1, 2);
  EXPECT_DOUBLE_EQ(*c1.device.kernels.find("linear", {1024, 128, 128, 1}), 1e-3);
  EXPECT_DOUBLE_EQ(*c1.device.kernels.experts(128, 256, 256, 1), 2e-4);
  EXPECT_FALSE(c1.comm_shares_cores);
  // Two one-thread processes: the one-thread times and the 2-process collectives.
  const ClusterSpec c2 = local_cluster(profile, 2, 1);
  EXPECT_DOUBLE_EQ(*c2.device.kernels.find("linear", {1024, 128, 128, 1}), 1.5e-3);
  EXPECT_DOUBLE_EQ(c2.intra_node_latency, 6e-6);
  EXPECT_DOUBLE_EQ(c2.intra_node_bandwidth, 3e9);
  EXPECT_DOUBLE_EQ(c2.intra_node_allreduce_bandwidth, 2e9);
  EXPECT_TRUE(c2.comm_shares_cores);
  // Four on two cores: half a core each (times doubled), the 4-process collectives.
  const ClusterSpec c4 = local_cluster(profile, 4, 1);
  EXPECT_DOUBLE_EQ(*c4.device.kernels.find("linear", {1024, 128, 128, 1}), 3e-3);
  EXPECT_DOUBLE_EQ(c4.intra_node_latency, 40e-6);
  EXPECT_DOUBLE_EQ(c4.intra_node_allreduce_bandwidth, 1.5e9);
  EXPECT_DOUBLE_EQ(c4.late_penalty, 3e-4);
  EXPECT_DOUBLE_EQ(c2.late_penalty, 0);
  EXPECT_DOUBLE_EQ(c2.a2a_receiver_bound, 0.25);
  EXPECT_DOUBLE_EQ(c4.a2a_receiver_bound, 1);
  EXPECT_DOUBLE_EQ(c2.self_reduce_bandwidth, 4e9);
  EXPECT_DOUBLE_EQ(c4.self_reduce_bandwidth, 0);
  // Three: the nearest measured count, the larger on a tie.
  EXPECT_DOUBLE_EQ(local_cluster(profile, 3, 1).intra_node_latency, 40e-6);
}

TEST(PlanMeasured, BadKernelRowsAndCollectiveListsAreNamed) {
  moetrain::testing::TempDir tmp("plan_measured_bad");
  DeviceModel all = cpu(2), one = cpu(1);
  const std::string good = (tmp.path() / "good.toml").string();
  save_profile(all, one, 5e9, 3e-6, {}, good);
  std::string text;
  {
    std::ifstream in(good);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto with = [&](const std::string& name, const std::string& device_line,
                  const std::string& cluster_line) {
    std::string t = text;
    t.insert(t.find("\n[single_thread]") + 1, device_line + "\n");
    t += cluster_line + "\n";
    const std::string path = (tmp.path() / name).string();
    std::ofstream(path) << t;
    return path;
  };
  auto message = [](const std::string& path) {
    try {
      local_cluster(path, 2, 1);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error in ") + path;
  };
  EXPECT_NE(message(with("short.toml", "kernels_linear = [[1024, 128, 128, 1e-3]]", ""))
                .find("device.kernels_linear"),
            std::string::npos);
  EXPECT_NE(message(with("negative.toml", "kernels_norm = [[1024, 128, -1e-3]]", ""))
                .find("device.kernels_norm must hold positive numbers"),
            std::string::npos);
  EXPECT_NE(message(with("lengths.toml", "",
                         "comm_procs = [2, 4]\ncomm_latency = [1e-6]\n"
                         "comm_alltoall_bandwidth = [1e9, 1e9]\ncomm_allreduce_bandwidth = [1e9, 1e9]"))
                .find("cluster.comm_procs"),
            std::string::npos);
}

TEST(PlanMeasured, EachMeasuredStepWaitsForItsOwnSlowestRank) {
  const RunConfig cfg = tiny();
  ClusterSpec c = one_process(cpu(1));
  c.devices_per_node = 2;
  // Step 1 sends 3/4 of the rows to rank 0's experts, step 2 to rank 1's: summed, balanced.
  std::vector<double> hot0(8, 0.25 / 4), hot1(8, 0.25 / 4);
  for (int e = 0; e < 4; ++e) hot0[e] = hot1[e + 4] = 0.75 / 4;
  LoadModel summed{"measured", {std::vector<double>(8, 1.0 / 8)}, {}};
  LoadModel by_step{"measured", summed.fractions, {{hot0}, {hot1}}};
  const Prediction even = predict(cfg, c, {.procs = 2, .ep = 2}, summed);
  const Prediction skew = predict(cfg, c, {.procs = 2, .ep = 2}, by_step);
  EXPECT_NEAR(even.imbalance, 1.0, 1e-9);
  EXPECT_NEAR(skew.imbalance, 1.5, 1e-9);
  EXPECT_GT(skew.parts.experts, 1.3 * even.parts.experts);
  EXPECT_NEAR(skew.parts.experts_mean, even.parts.experts_mean, 0.05 * even.parts.experts_mean);
}

TEST(PlanMeasured, AnAllToAllOverASharedLinkWaitsForAllBytesNotTheHotRanks) {
  const RunConfig cfg = tiny();
  ClusterSpec c = one_process(cpu(1));
  c.devices_per_node = 2;
  c.intra_node_bandwidth = 1e8;  // the all-to-all's bytes dominate its latency
  // 3/4 of the rows to rank 0's experts: rank 0 receives 1.5× what a rank sends at uniform load.
  std::vector<double> hot(8, 0.25 / 4);
  for (int e = 0; e < 4; ++e) hot[e] = 0.75 / 4;
  const LoadModel skewed{"measured", {hot}, {}};
  const Layout two{.procs = 2, .ep = 2};
  const double even = predict(cfg, c, two, uniform_load(8)).parts.a2a;
  // Links per rank: the hot rank's bytes; one shared link: all ranks' bytes, the mean send.
  const double per_rank = predict(cfg, c, two, skewed).parts.a2a;
  c.a2a_receiver_bound = 0;
  const double shared = predict(cfg, c, two, skewed).parts.a2a;
  c.a2a_receiver_bound = 0.5;
  const double half = predict(cfg, c, two, skewed).parts.a2a;
  const double lat = 2 * 4 * c.intra_node_latency;  // 2 MoE layers × 4 exchanges, 1 message
  EXPECT_NEAR((per_rank - lat) / (even - lat), 1.5, 1e-6);
  EXPECT_NEAR(shared, even, 1e-12);
  EXPECT_NEAR(half, (per_rank + shared) / 2, 1e-12);
}

TEST(PlanMeasured, ExpertGradientsOverAGroupOfOneCostTheirMeasuredCopies) {
  const RunConfig cfg = tiny();
  ClusterSpec c = one_process(cpu(1));
  c.devices_per_node = 4;
  const LoadModel load = uniform_load(8);
  const double free_ep2 = predict(cfg, c, {.procs = 2, .ep = 2}, load).parts.grad_sync;
  c.self_reduce_bandwidth = 1e9;
  const ParamCounts pc = count_params(cfg.model);
  // EP=2 without DP: each rank's half of the experts through the reduction's copies.
  EXPECT_NEAR(predict(cfg, c, {.procs = 2, .ep = 2}, load).parts.grad_sync - free_ep2,
              pc.expert / 2 * 4 / 1e9, 1e-12);
  // With DP the experts' reduction is a real all-reduce (calibrated with its copies); one
  // process reduces nothing.
  ClusterSpec free = c;
  free.self_reduce_bandwidth = 0;
  EXPECT_DOUBLE_EQ(predict(cfg, c, {.procs = 4, .ep = 2}, load).parts.grad_sync,
                   predict(cfg, free, {.procs = 4, .ep = 2}, load).parts.grad_sync);
  EXPECT_DOUBLE_EQ(predict(cfg, c, {}, load).parts.grad_sync, 0);
}

TEST(PlanMeasured, OversubscribedComputeGetsTheShareMeasuredAtItsRatio) {
  moetrain::testing::TempDir tmp("plan_measured_share");
  // Interpolated in log ratio between the measured points, clamped at the ends.
  ClusterSpec c = one_process(cpu(1));
  c.compute_share_ratio = {0.25, 1, 4};
  c.compute_share = {0.9, 0.6, 0.5};
  EXPECT_DOUBLE_EQ(compute_share(c, 0.1), 0.9);
  EXPECT_DOUBLE_EQ(compute_share(c, 1), 0.6);
  EXPECT_NEAR(compute_share(c, 0.5), 0.75, 1e-12);
  EXPECT_DOUBLE_EQ(compute_share(c, 100), 0.5);
  EXPECT_DOUBLE_EQ(compute_share(one_process(cpu(1)), 1), 1);
  // The compute parts are the process's alone, divided by the share at the run's ratio of
  // compute (alone) to exposed communication; the communication stays as it is.
  RunConfig cfg = tiny();
  c.devices_per_node = 4;
  c.comm_shares_cores = true;
  ClusterSpec alone = c;
  alone.compute_share_ratio.clear();
  alone.compute_share.clear();
  const Prediction a = predict(cfg, alone, {.procs = 4, .ep = 4}, uniform_load(8));
  const Prediction p = predict(cfg, c, {.procs = 4, .ep = 4}, uniform_load(8));
  const double comm = a.parts.a2a_exposed + a.parts.grad_sync_exposed + a.parts.sync;
  const double share = compute_share(c, a.parts.compute() / comm);
  EXPECT_DOUBLE_EQ(p.compute_share, share);
  EXPECT_DOUBLE_EQ(a.compute_share, 1);
  EXPECT_NEAR(p.parts.compute(), a.parts.compute() / share, 1e-12);
  EXPECT_NEAR(p.parts.experts, a.parts.experts / share, 1e-12);
  EXPECT_DOUBLE_EQ(p.parts.a2a, a.parts.a2a);
  EXPECT_NEAR(p.step_time_s, a.step_time_s + a.parts.compute() * (1 / share - 1), 1e-12);
  // A skewed load: the share looked up at the balanced compute; every part, the slowest rank's
  // experts included, at that share.
  const Prediction az = predict(cfg, alone, {.procs = 4, .ep = 4}, zipf_load(8, 1.2));
  const Prediction pz = predict(cfg, c, {.procs = 4, .ep = 4}, zipf_load(8, 1.2));
  const double balanced = az.parts.compute() - az.parts.experts + az.parts.experts_mean;
  EXPECT_DOUBLE_EQ(pz.compute_share,
                   compute_share(c, balanced / (az.parts.a2a_exposed +
                                                az.parts.grad_sync_exposed + az.parts.sync)));
  EXPECT_NEAR(pz.parts.experts, az.parts.experts / pz.compute_share, 1e-12);
  EXPECT_NEAR(pz.parts.attention, az.parts.attention / pz.compute_share, 1e-12);

  // Through the profile: one-thread processes that outnumber the cores get the one-thread
  // times unscaled (a process alone) and the share measured with their count; other thread
  // counts, or counts not measured, the fair share of the cores.
  DeviceModel all = cpu(2), one = cpu(1);
  one.kernels.add("linear", {1024, 128, 128, 1}, 1.5e-3);
  CommFigures f4{4, 40e-6, 2e9, 1.5e9, 3e-4, 1, 0, {0.25, 1, 4}, {0.9, 0.6, 0.45}};
  const std::string cf = (tmp.path() / "c4.txt").string();
  write_comm_figures(f4, cf);
  const CommFigures back = read_comm_figures(cf);
  EXPECT_EQ(back.share_ratio, f4.share_ratio);
  EXPECT_EQ(back.share, f4.share);
  const std::string profile = (tmp.path() / "p.toml").string();
  save_profile(all, one, 5e9, 3e-6, {CommFigures{2, 6e-6, 3e9, 2e9, 0, 1, 4e9, {}, {}}, back},
               profile);
  const ClusterSpec c4 = local_cluster(profile, 4, 1);
  EXPECT_DOUBLE_EQ(*c4.device.kernels.find("linear", {1024, 128, 128, 1}), 1.5e-3);
  // Below the fair share (half a core) reads as the fair share.
  EXPECT_EQ(c4.compute_share, (std::vector<double>{0.9, 0.6, 0.5}));
  EXPECT_EQ(c4.compute_share_ratio, f4.share_ratio);
  EXPECT_TRUE(c4.comm_shares_cores);
  const ClusterSpec c4t2 = local_cluster(profile, 4, 2);
  EXPECT_TRUE(c4t2.compute_share.empty());
  EXPECT_DOUBLE_EQ(*c4t2.device.kernels.find("linear", {1024, 128, 128, 1}), 3e-3);
  const ClusterSpec c8 = local_cluster(profile, 8, 1);
  EXPECT_TRUE(c8.compute_share.empty());
  EXPECT_DOUBLE_EQ(*c8.device.kernels.find("linear", {1024, 128, 128, 1}), 6e-3);
  EXPECT_TRUE(local_cluster(profile, 2, 1).compute_share.empty());
  // A malformed table is named.
  {
    std::ofstream(profile, std::ios::app) << "compute_share_p3 = [[1, 0.5], [0.5, 0.6]]\n";
  }
  try {
    local_cluster(profile, 3, 1);
    FAIL() << "descending ratios accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("compute_share_p3"), std::string::npos) << e.what();
  }
}

// The calibration times every kernel of the config at the config's own shapes, with every thread
// and with one a core, and the cost model then takes the experts as timed.
TEST(PlanMeasured, CalibrationTimesTheConfigsKernelsAtItsShapes) {
  RunConfig cfg = tiny();
  cfg.train.batch_size = 2;
  cfg.train.seq_len = 64;  // N = 128 tokens; N·K/E = 32 rows an expert
  const Calibration cal = calibrate(false, &cfg);
  const ParamLayout layout(cfg.model);
  const std::vector<std::pair<std::string, std::vector<double>>> expected = {
      {"linear", {128, 128, 128, 1}},   // q and o projections
      {"linear", {128, 128, 64, 1}},    // k and v (2 KV heads of 32)
      {"linear", {128, 128, 256, 1}},   // LM head
      {"attention", {2, 64, 4, 2, 32}},
      {"experts", {128, 256, 8, 1}},    // a quarter of the uniform rows,
      {"experts", {128, 256, 32, 1}},   // the uniform rows,
      {"experts", {128, 256, 64, 1}},   // twice them
      {"norm", {128, 128}},
      {"rope", {128, 4, 32}},
      {"rope", {128, 2, 32}},
      {"optimizer", {static_cast<double>(layout.size()), optimizer_code("adamw")}}};
  for (const DeviceModel* d : {&cal.device, &cal.single_thread}) {
    std::size_t rows = 0;
    for (const auto& [kind, list] : d->kernels.rows) rows += list.size();
    EXPECT_EQ(rows, expected.size());
    for (const auto& [kind, shape] : expected) {
      const auto s = d->kernels.find(kind, shape);
      ASSERT_TRUE(s.has_value()) << kind << " not timed at its shape";
      EXPECT_TRUE(std::isfinite(*s) && *s > 0 && *s < 1) << kind << ": " << *s << " s";
    }
  }
  // One process at the uniform load: each layer's 8 experts at 32 rows, as timed.
  DeviceModel d = cal.device;
  const double per_expert = *d.kernels.find("experts", {128, 256, 32, 1});
  EXPECT_NEAR(predict(cfg, one_process(d), {}, uniform_load(8)).parts.experts,
              8 * 2 * per_expert, 1e-12);
}
