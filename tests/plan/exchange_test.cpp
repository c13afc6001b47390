// The expert exchange in the planner: as DeepEP runs it (a token crosses to each node holding one
// of its experts once and is fanned out there over NVLink; node-limited routing caps the nodes a
// token reaches), on a rail-optimised network (the flat route's rows for other positions cross
// the spine), the adaptive route (the cheaper of flat and 2-D), and overlapped with another
// micro-batch's compute.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/check.h"
#include "plan/ablation.h"
#include "plan/cluster.h"
#include "plan/comm_model.h"
#include "plan/cost_model.h"
#include "support/expect_error.h"
#include "support/plan_clusters.h"

using namespace moetrain;
using namespace moetrain::plan;
using moetrain::testing::a100_nodes;

namespace {

RunConfig moe_1024() {
  RunConfig cfg;
  cfg.model.vocab_size = 1024;
  cfg.model.dim = 1024;
  cfg.model.n_layers = 2;
  cfg.model.n_heads = 8;
  cfg.model.n_kv_heads = 8;
  cfg.model.expert_hidden = 512;
  cfg.model.n_experts = 64;
  cfg.model.top_k = 6;
  cfg.model.max_seq_len = 2048;
  cfg.train.batch_size = 1;
  cfg.train.seq_len = 2048;
  cfg.train.precision = Precision::BF16;
  return cfg;
}

}  // namespace

// 64 experts on 8 nodes, top-8: a node other than the token's misses all 8 of its experts with
// probability C(56, 8) / C(64, 8) = 0.3209…, so a token reaches 7 · 0.6791 = 4.75 other nodes for
// its 7 remote rows; limited to 4 nodes in all, 3.5 of them remote.
TEST(PlanExchange, DistinctNodesOverRowsByHand) {
  EXPECT_NEAR(dedup_share(64, 8, 8, 0), 0.6790689102423071, 1e-12);
  EXPECT_NEAR(dedup_share(64, 8, 8, 4), 0.5, 1e-12);
  EXPECT_DOUBLE_EQ(dedup_share(64, 8, 1, 0), 1);  // one node: nothing crosses
  EXPECT_DOUBLE_EQ(dedup_share(64, 1, 8, 0), 1);  // top-1: a row is a token
  // 2 experts a node, top-2 of 16 over 8 nodes: both on the same other node only rarely.
  EXPECT_NEAR(dedup_share(16, 2, 8, 0), 7 * (1 - 14.0 / 16 * 13.0 / 15) / (2 * 7.0 / 8), 1e-12);
}

// The phases: rows to the rank's own node go directly over NVLink; rows for other nodes cross
// once per node (the dedup share) and are fanned out there, the two at once.
TEST(PlanExchange, DeduplicatedPhasesByHand) {
  const ClusterSpec c = a100_nodes(2);
  const double B = 15e6;
  const Collective d = alltoall_dedup(c, B, 16, 0.5);
  ASSERT_EQ(d.kind, "deduplicated");
  ASSERT_EQ(d.phases.size(), 2u);
  EXPECT_TRUE(d.concurrent);
  EXPECT_DOUBLE_EQ(d.phases[0].bytes, B * 7 / 15 + B * 8 / 15 * 7 / 8);
  EXPECT_DOUBLE_EQ(d.phases[0].messages, 7);
  EXPECT_DOUBLE_EQ(d.phases[1].bytes, B * 8 / 15 * 0.5);
  EXPECT_DOUBLE_EQ(d.phases[1].messages, 1);
  EXPECT_DOUBLE_EQ(d.phases[1].sharing, 8);
  EXPECT_EQ(alltoall_dedup(c, B, 8, 0.5).kind, "flat");  // one node
}

// Through the model: the 1024-A100 ablation's shape (64 experts, top-6, EP 64 over 8 nodes)
// exchanges less with the deduplicated form, and what is written out is what the step pays.
TEST(PlanExchange, DeduplicatedExchangeIsWhatTheStepPays) {
  RunConfig cfg = moe_1024();
  const ClusterSpec c = a100_nodes(8);
  Layout flat{64, 64}, dedup{64, 64};
  dedup.a2a_dedup = true;
  const Prediction pf = predict(cfg, c, flat, uniform_load(64));
  const Prediction pd = predict(cfg, c, dedup, uniform_load(64));
  EXPECT_EQ(pd.a2a_kind, "deduplicated");
  EXPECT_LT(pd.parts.a2a, pf.parts.a2a);
  EXPECT_NEAR(pd.comm.a2a_exchanges * pd.comm.a2a_deduplicated.seconds(), pd.parts.a2a,
              1e-9 * pd.parts.a2a);
  EXPECT_FALSE(trainer_runs(cfg, dedup));
  EXPECT_FALSE(pd.trainer_runs());
  Layout zero3 = flat;  // fully sharded: the trainer runs it (dist.zero = 3)
  zero3.zero = 3;
  EXPECT_TRUE(trainer_runs(cfg, zero3)) << planner_only(cfg, zero3);
  // Node-limited routing (8 groups, one a node; a token in at most 2) sends less again.
  cfg.model.route_groups = 8;
  cfg.model.route_group_topk = 2;
  EXPECT_LT(predict(cfg, c, dedup, uniform_load(64)).parts.a2a, pd.parts.a2a);
}

// A rail-optimised network: of a rank's rows for the 8 ranks of the other node, the eighth bound
// for its own position goes along its rail, the other seven eighths across the spine, at once.
// The 2-D route sends everything to the same-position rank: the spine changes nothing there.
TEST(PlanExchange, RailsSendTheFlatRoutesOtherPositionsAcrossTheSpine) {
  ClusterSpec c = a100_nodes(2);
  const double B = 15e6;
  const Collective one = alltoall(c, B, 16, false), hier = alltoall(c, B, 16, true);
  c.spine_bandwidth = 50e9;
  const Collective flat = alltoall(c, B, 16, false);
  ASSERT_EQ(flat.phases.size(), 3u);
  EXPECT_TRUE(flat.concurrent);
  EXPECT_EQ(flat.phases[1].name, "along the rails");
  EXPECT_DOUBLE_EQ(flat.phases[1].messages, 1);
  EXPECT_DOUBLE_EQ(flat.phases[1].bytes, B * 8 / 15 / 8);
  EXPECT_DOUBLE_EQ(flat.phases[1].bandwidth, 200e9);
  EXPECT_EQ(flat.phases[2].name, "across the spine");
  EXPECT_DOUBLE_EQ(flat.phases[2].messages, 7);
  EXPECT_DOUBLE_EQ(flat.phases[2].bytes, B * 8 / 15 * 7 / 8);
  EXPECT_DOUBLE_EQ(flat.phases[2].bandwidth, 50e9);
  EXPECT_DOUBLE_EQ(flat.phases[2].sharing, 8);
  // The spine's share at a quarter of the rails' rate: slower than one network at the rails' rate.
  EXPECT_GT(flat.seconds(), one.seconds());
  EXPECT_DOUBLE_EQ(alltoall(c, B, 16, true).seconds(), hier.seconds());
  EXPECT_EQ(alltoall(c, B, 8, false).phases.size(), 1u);  // one node: no spine
}

// dist.adaptive_route in the planner: the cheaper of the two routes. Between two nodes the flat
// route is the cheaper on one network; a spine at 1% of the rails' rate makes it the 2-D route,
// whose time the spine does not change.
TEST(PlanExchange, AdaptiveRouteTakesTheCheaperPath) {
  const RunConfig cfg = moe_1024();
  ClusterSpec c = a100_nodes(2);
  const Layout l{16, 16};
  std::vector<std::string> kinds;
  double hier_s = 0;
  for (const double spine : {0.0, 2e9}) {
    SCOPED_TRACE(spine);
    c.spine_bandwidth = spine;
    RunConfig flat = cfg, hier = cfg;
    flat.dist.hierarchical = false;
    hier.dist.hierarchical = true;
    const Prediction f = predict(flat, c, l, uniform_load(64));
    const Prediction h = predict(hier, c, l, uniform_load(64));
    const Prediction a = predict_adaptive(cfg, c, l, uniform_load(64));
    EXPECT_EQ(a.step_time_s, std::min(f.step_time_s, h.step_time_s));
    EXPECT_EQ(a.a2a_kind, (h.step_time_s < f.step_time_s ? h : f).a2a_kind);
    if (spine > 0) {
      EXPECT_EQ(h.step_time_s, hier_s);
    }
    hier_s = h.step_time_s;
    kinds.push_back(a.a2a_kind);
  }
  EXPECT_EQ(kinds, (std::vector<std::string>{"flat", "hierarchical"}));
}

// cluster.spine_bandwidth and cluster.disk_bandwidth are optional, and when given must be numbers
// ≥ 0.
TEST(PlanExchange, SpineBandwidthFromTheClusterFile) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("moetrain_spine_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()));
  std::filesystem::create_directories(dir);
  auto cluster = [&](const std::string& extra) {
    const auto path = dir / "cluster.toml";
    std::ofstream(path) << "[cluster]\ndevice = \"a100\"\ndevices_per_node = 8\nnodes = 2\n"
                           "intra_node_bandwidth = 300e9\ninter_node_bandwidth = 200e9\n"
                           "intra_node_latency = 3e-6\ninter_node_latency = 10e-6\n"
                        << extra;
    return load_cluster(path.string(), "");
  };
  EXPECT_EQ(cluster("").spine_bandwidth, 0);
  EXPECT_EQ(cluster("spine_bandwidth = 25e9\n").spine_bandwidth, 25e9);
  moetrain::testing::expect_error([&] { cluster("spine_bandwidth = -1\n"); },
                                  "cluster.spine_bandwidth");
  EXPECT_EQ(cluster("").disk_bandwidth, 0);
  EXPECT_EQ(cluster("disk_bandwidth = 2e9\n").disk_bandwidth, 2e9);
  moetrain::testing::expect_error([&] { cluster("disk_bandwidth = -1\n"); },
                                  "cluster.disk_bandwidth");
  std::filesystem::remove_all(dir);
}

// The exchange overlapped with another micro-batch's compute (--a2a-overlap), by hand: the
// layers' compute is 1 + 0.5 + 2 + 0.5 = 4 s a step over 4 micro-batches; the first has no other
// micro-batch beside it, so 3 s can hide an exchange, less what the chunks hid already.
TEST(PlanExchange, OverlapWithAnotherMicroBatchByHand) {
  StepParts s;
  s.attention = 1, s.router = 0.5, s.experts = 2, s.norms = 0.5;
  s.lm_head = 7, s.optimizer = 9;  // beside no exchange: not counted
  s.a2a = s.a2a_exposed = 5;
  Layout on{8, 8};
  on.a2a_overlap = true;
  EXPECT_DOUBLE_EQ(other_microbatch_hidden(on, s, 4, false), 3);
  s.a2a_exposed = 4;  // the chunks hid 1 s behind the experts
  EXPECT_DOUBLE_EQ(other_microbatch_hidden(on, s, 4, false), 2);
  s.a2a = 1.5, s.a2a_exposed = 1;  // less than the window: all of it
  EXPECT_DOUBLE_EQ(other_microbatch_hidden(on, s, 4, false), 1);
  EXPECT_DOUBLE_EQ(other_microbatch_hidden(on, s, 1, false), 0);  // one micro-batch
  EXPECT_DOUBLE_EQ(other_microbatch_hidden(on, s, 4, true), 0);   // communication takes a core
  EXPECT_DOUBLE_EQ(other_microbatch_hidden(Layout{8, 8}, s, 4, false), 0);  // not asked
  EXPECT_FALSE(trainer_runs(RunConfig{}, on));
  EXPECT_NE(planner_only(RunConfig{}, on).find("all-to-all overlapped with another micro-batch"),
            std::string::npos);
}

// Through the model: EP 64 over 8 nodes, where the exchange outlasts the compute, the step
// shortens by exactly what the formula hides, and one micro-batch gains nothing.
TEST(PlanExchange, OverlapWithAnotherMicroBatchIsWhatTheStepSaves) {
  RunConfig cfg = moe_1024();
  cfg.train.grad_accum = 4;
  const ClusterSpec c = a100_nodes(8);
  Layout plain{64, 64}, over{64, 64};
  over.a2a_overlap = true;
  const Prediction p = predict(cfg, c, plain, uniform_load(64));
  const Prediction o = predict(cfg, c, over, uniform_load(64));
  const StepParts& s = p.parts;
  const double layers = s.attention + s.router + s.experts + s.shared_expert + s.norms;
  ASSERT_GT(s.a2a_exposed, 0.75 * layers);  // the exchange outlasts what can hide it
  EXPECT_NEAR(o.parts.a2a_exposed, s.a2a_exposed - 0.75 * layers, 1e-9 * s.a2a_exposed);
  // The step saves what the overlap hides, less what the hidden exchange takes from the compute
  // beside it (the device's comm_compute_share of it: 20 of an A100's 108 multiprocessors).
  EXPECT_NEAR(o.parts.comm_contention - s.comm_contention,
              c.device.comm_compute_share * 0.75 * layers, 1e-9 * p.step_time_s);
  EXPECT_DOUBLE_EQ(c.device.comm_compute_share, 20.0 / 108);
  EXPECT_NEAR(o.step_time_s,
              p.step_time_s - (1 - c.device.comm_compute_share) * 0.75 * layers,
              1e-9 * p.step_time_s);
  // Pipelined, the fill and the drain run one micro-batch a stage: the bubble keeps its exchanges.
  Layout plain_pp{64, 32, 1, 2}, over_pp = plain_pp;
  over_pp.a2a_overlap = true;
  const Prediction pp = predict(cfg, c, plain_pp, uniform_load(64));
  const Prediction op = predict(cfg, c, over_pp, uniform_load(64));
  EXPECT_LT(op.parts.a2a_exposed, pp.parts.a2a_exposed);
  EXPECT_DOUBLE_EQ(op.parts.pipeline_bubble, pp.parts.pipeline_bubble);
  cfg.train.grad_accum = 1;
  EXPECT_DOUBLE_EQ(predict(cfg, c, over, uniform_load(64)).step_time_s,
                   predict(cfg, c, plain, uniform_load(64)).step_time_s);
}
