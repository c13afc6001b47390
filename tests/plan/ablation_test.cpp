// The design's ablation as `moetrain plan --ablation` models it (five cumulative rows) and the
// cluster-size advice of `plan --advise`: each figure against an evaluation of the cost model the
// test makes itself, from the config file and the row's settings as --set takes them. Pure
// arithmetic: the same inputs give the same doubles, so the comparisons are exact.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "plan/ablation.h"
#include "plan/advise.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "train/run_config.h"

using namespace moetrain;
using namespace moetrain::plan;

namespace {

std::string plan_file(const std::string& name) {
  return std::string(MOETRAIN_SOURCE_DIR) + "/configs/plan/" + name;
}

const std::string kConfig = plan_file("ablation_moe_1024.toml");

ClusterSpec a100(int64_t devices) {
  ClusterSpec c = load_cluster(plan_file("a100_1024.toml"), "");
  c.nodes = devices / c.devices_per_node;
  return c;
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// The row's prediction made here: the config file with the row's settings, the row's load built
// from its spec, the cheaper exchange where the row is adaptive.
Prediction evaluate(const AblationRow& r, const ClusterSpec& c, const Layout& l) {
  const RunConfig cfg = load_run_config(kConfig, r.settings);
  const int64_t E = cfg.model.n_experts;
  const LoadModel load = r.load == "uniform" ? uniform_load(E) : zipf_load(E, 1.0);
  EXPECT_TRUE(r.load == "uniform" || r.load == "zipf:1") << r.load;
  if (!r.adaptive) return predict(cfg, c, l, load);
  RunConfig flat = cfg, hier = cfg;
  flat.dist.hierarchical = false;
  hier.dist.hierarchical = true;
  const Prediction f = predict(flat, c, l, load), h = predict(hier, c, l, load);
  return f.step_time_s <= h.step_time_s ? f : h;
}

}  // namespace

TEST(PlanAblation, RowsAreCumulative) {
  const RunConfig cfg = load_run_config(kConfig, {});
  const auto rows = ablation(cfg, a100(1024), {.procs = 1024, .ep = 64}, 1.0);
  ASSERT_EQ(rows.size(), 5u);
  for (std::size_t i = 1; i < rows.size(); ++i) {
    const auto& prev = rows[i - 1].settings;
    const auto& cur = rows[i].settings;
    ASSERT_GE(cur.size(), prev.size()) << rows[i].name;
    EXPECT_TRUE(std::equal(prev.begin(), prev.end(), cur.begin()))
        << rows[i].name << " does not begin with " << rows[i - 1].name << "'s settings";
    EXPECT_TRUE(!rows[i - 1].adaptive || rows[i].adaptive) << rows[i].name;
    if (i >= 2) {
      EXPECT_EQ(rows[i].load, rows[i - 1].load) << rows[i].name;
    }
  }
  // What each group is: the design's baseline, then one group at a time.
  EXPECT_EQ(rows[0].load, "zipf:1");
  for (const char* s : {"dist.hierarchical=false", "dist.a2a_chunks=1", "dist.overlap=false",
                        "dist.grad_reduce_dtype=f32", "grad.sparse_experts=false",
                        "grad.expert_reweight=none"})
    EXPECT_TRUE(contains(rows[0].settings, s)) << s;
  EXPECT_EQ(rows[1].load, "uniform");
  for (const char* s : {"dist.hierarchical=true", "dist.a2a_chunks=4", "dist.a2a_dtype=bf16"})
    EXPECT_TRUE(contains(rows[2].added, s)) << s;
  for (const char* s : {"grad.sparse_experts=true", "grad.expert_reweight=importance",
                        "dist.grad_reduce_dtype=int8", "dist.overlap=true"})
    EXPECT_TRUE(contains(rows[3].added, s)) << s;
  EXPECT_FALSE(rows[3].adaptive);
  EXPECT_TRUE(rows[4].adaptive);
  // Row 4's settings through the loader: every group so far in force at once.
  const RunConfig r4 = load_run_config(kConfig, rows[3].settings);
  EXPECT_TRUE(r4.dist.hierarchical);
  EXPECT_EQ(r4.dist.a2a_chunks, 4);
  EXPECT_EQ(r4.dist.a2a_dtype, "bf16");
  EXPECT_TRUE(r4.grad.sparse_experts);
  EXPECT_EQ(r4.grad.expert_reweight, "importance");
  EXPECT_EQ(r4.dist.grad_reduce_dtype, "int8");
  EXPECT_TRUE(r4.dist.overlap);
}

// Every printed figure, ours and the design's, in the text and the JSON.
TEST(PlanAblation, FiguresAreTheCostModelsAndTheDesigns) {
  const RunConfig cfg = load_run_config(kConfig, {});
  const ClusterSpec c = a100(1024);
  const Layout l{.procs = 1024, .ep = 64};
  const auto rows = ablation(cfg, c, l, 1.0);
  const std::string text = format_ablation(rows, cfg.train.seq_len);
  const nlohmann::json j = ablation_json(rows, cfg.train.seq_len);
  std::cout << text;
  const double design[5][3] = {
      {0.35, 0.45, 125}, {0.82, 0.45, 183}, {0.82, 0.78, 256}, {0.85, 0.78, 287}, {0.88, 0.82, 312}};
  const double T = static_cast<double>(cfg.train.seq_len);
  const Prediction base = evaluate(rows[0], c, l);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE(rows[i].name);
    const Prediction p = evaluate(rows[i], c, l);
    const StepParts& s = p.parts;
    EXPECT_EQ(rows[i].prediction.step_time_s, p.step_time_s);
    EXPECT_EQ(rows[i].prediction.tokens_per_s, p.tokens_per_s);
    EXPECT_EQ(rows[i].prediction.utilisation, p.utilisation);
    const double exposed = s.compute() / (s.compute() + s.a2a_exposed + s.grad_sync_exposed +
                                          s.tensor_parallel + s.sync);
    const double all =
        s.compute() / (s.compute() + s.a2a + s.grad_sync + s.tensor_parallel + s.sync);
    const double sps = p.tokens_per_s / T, ratio = p.tokens_per_s / base.tokens_per_s;
    EXPECT_DOUBLE_EQ(j[i]["samples_per_s"].get<double>(), sps);
    EXPECT_DOUBLE_EQ(j[i]["ratio_to_baseline"].get<double>(), ratio);
    EXPECT_DOUBLE_EQ(j[i]["comm_efficiency_exposed"].get<double>(), exposed);
    EXPECT_DOUBLE_EQ(j[i]["comm_efficiency_all"].get<double>(), all);
    EXPECT_EQ(j[i]["design"]["utilisation"].get<double>(), design[i][0]);
    EXPECT_EQ(j[i]["design"]["comm_efficiency"].get<double>(), design[i][1]);
    EXPECT_EQ(j[i]["design"]["samples_per_s"].get<double>(), design[i][2]);
    EXPECT_DOUBLE_EQ(j[i]["design"]["ratio_to_baseline"].get<double>(), design[i][2] / 125);
    // The text row: ours and the design's side by side, in the order of the header.
    const std::size_t at = text.find("\n" + rows[i].name);
    ASSERT_NE(at, std::string::npos);
    std::istringstream line(text.substr(at + 1 + rows[i].name.size(),
                                        text.find('\n', at + 1) - at - 1 - rows[i].name.size()));
    std::vector<std::string> cells;
    for (std::string w; line >> w;) cells.push_back(w);
    const std::vector<std::string> want = {
        fmt::format("{:.2f}", p.utilisation),   fmt::format("{:.2f}", design[i][0]),
        fmt::format("{:.2f}", p.experts_active), fmt::format("{:.2f}", exposed),
        fmt::format("{:.2f}", all),             fmt::format("{:.2f}", design[i][1]),
        fmt::format("{:.0f}", sps),             fmt::format("{:.0f}", design[i][2]),
        fmt::format("{:.2f}", ratio),           fmt::format("{:.2f}", design[i][2] / 125)};
    EXPECT_EQ(cells, want);
  }
  EXPECT_NE(text.find("2.50"), std::string::npos) << "the design's row 5 over its baseline";
}

// Where the model says so, at the design's 1024 A100 and at larger scales of the same nodes:
// balancing beats the baseline, each later row keeps or improves on row 2 (the groups after
// balancing only remove or hide communication), and everything (the cheaper exchange) is at least
// row 4.
TEST(PlanAblation, RowOrderHoldsWhereTheModelSaysSo) {
  const RunConfig cfg = load_run_config(kConfig, {});
  for (const int64_t procs : {1024, 4096, 16384}) {
    const auto rows = ablation(cfg, a100(procs), {.procs = procs, .ep = 64}, 1.0);
    std::cout << procs << " A100:\n" << format_ablation(rows, cfg.train.seq_len);
    const auto tps = [&](std::size_t i) { return rows[i].prediction.tokens_per_s; };
    EXPECT_GT(tps(1), tps(0)) << procs;
    for (std::size_t i = 2; i < rows.size(); ++i) EXPECT_GE(tps(i), tps(1)) << procs << " " << i;
    EXPECT_GE(tps(4), tps(3)) << procs;
    EXPECT_GT(rows[4].prediction.utilisation, rows[0].prediction.utilisation) << procs;
    EXPECT_GT(comm_efficiency_exposed(rows[4].prediction.parts),
              comm_efficiency_exposed(rows[0].prediction.parts))
        << procs;
  }
}

// The advice at a small and a large cluster, each decision against the step times the test
// predicts itself; they differ where the cost model says they do.
TEST(PlanAdvise, SmallAndLargeClustersAsTheCostModelSays) {
  const RunConfig cfg = load_run_config(kConfig, {});
  const ClusterSpec c = load_cluster(plan_file("a100_1024.toml"), "");
  const std::vector<std::string> simple = {"placement.spare_slots=0", "dist.hierarchical=false",
                                           "grad.min_accum_fraction=0",
                                           "grad.sparse_experts=false"};
  std::vector<std::vector<SizeAdvice>> by_load;
  for (const LoadModel& load : {uniform_load(cfg.model.n_experts),
                                zipf_load(cfg.model.n_experts, 1.0)}) {
    const auto rows = advise(cfg, c, {.procs = 1024, .ep = 64}, {8, 4096}, load);
    std::cout << load.kind << " load:\n" << format_advice(rows);
    ASSERT_EQ(rows.size(), 2u);
    auto step = [&](int64_t n, const std::string& change) {
      std::vector<std::string> s = simple;
      if (!change.empty()) s.push_back(change);
      ClusterSpec cn = c;
      cn.nodes = (n + 7) / 8;
      return predict(load_run_config(kConfig, s), cn,
                     {.procs = n, .ep = std::min<int64_t>(64, n)}, load)
          .step_time_s;
    };
    for (const SizeAdvice& a : rows) {
      SCOPED_TRACE(load.kind + " " + std::to_string(a.devices));
      ASSERT_TRUE(a.problem.empty()) << a.problem;
      EXPECT_EQ(a.ep, std::min<int64_t>(64, a.devices));
      const double base = step(a.devices, "");
      const double dynamic = step(a.devices, "placement.spare_slots=1");
      const double hier = step(a.devices, "dist.hierarchical=true");
      const double sparse = step(a.devices, "grad.sparse_experts=true");
      EXPECT_EQ(a.balancing.simple_s, base);
      EXPECT_EQ(a.balancing.advanced_s, dynamic);
      EXPECT_EQ(a.exchange.advanced_s, hier);
      EXPECT_EQ(a.gradients.advanced_s, sparse);
      EXPECT_EQ(a.balancing.choice(), dynamic < 0.99 * base ? "dynamic" : "static");
      EXPECT_EQ(a.exchange.choice(), hier < 0.99 * base ? "hierarchical" : "flat");
      EXPECT_EQ(a.gradients.choice(), sparse < 0.99 * base ? "sparse" : "dense");
      EXPECT_EQ(a.adaptive, hier < base ? "hierarchical" : "flat");
      // Every expert sees tokens in every micro-batch at both sizes: sparse gradients only add
      // their mask's all-reduce.
      EXPECT_EQ(a.gradients.choice(), "dense");
    }
    by_load.push_back(rows);
  }
  // Balanced load: on one node the 2-D exchange is the flat one (nothing leaves the node); over
  // 8 nodes it saves the inter-node latencies and pays. Replicas only cost traffic there.
  const auto& uniform = by_load[0];
  EXPECT_EQ(uniform[0].exchange.choice(), "flat");
  EXPECT_EQ(uniform[0].exchange.advanced_s, uniform[0].exchange.simple_s);
  EXPECT_EQ(uniform[1].exchange.choice(), "hierarchical");
  for (const SizeAdvice& a : uniform) EXPECT_EQ(a.balancing.choice(), "static") << a.devices;
  // Zipf(1): replicating the hot experts pays at both sizes.
  for (const SizeAdvice& a : by_load[1]) EXPECT_EQ(a.balancing.choice(), "dynamic") << a.devices;
  EXPECT_EQ(design_tier(uniform[0].devices).name, "small");
  EXPECT_EQ(design_tier(uniform[1].devices).name, "large");
}

// The design's tiers at their edges, and the sizes --advise takes.
TEST(PlanAdvise, TiersAndSizes) {
  EXPECT_EQ(design_tier(256).name, "small");
  EXPECT_EQ(design_tier(257).name, "medium");
  EXPECT_EQ(design_tier(2047).name, "medium");
  EXPECT_EQ(design_tier(2048).name, "large");
  const ClusterSpec c = load_cluster(plan_file("a100_1024.toml"), "");
  EXPECT_EQ(default_advice_sizes(c), (std::vector<int64_t>{8, 16, 32, 64, 128, 256, 512, 1024}));
  ClusterSpec odd = c;
  odd.nodes = 3;
  EXPECT_EQ(default_advice_sizes(odd), (std::vector<int64_t>{8, 16, 24}));
  EXPECT_EQ(parse_advice_sizes("8,4096"), (std::vector<int64_t>{8, 4096}));
  for (const char* bad : {"0", "8,x", "8,,16", "-4", "1.5", ""}) {
    try {
      parse_advice_sizes(bad);
      ADD_FAILURE() << "'" << bad << "' was taken";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("--sizes"), std::string::npos) << e.what();
    }
  }
}
