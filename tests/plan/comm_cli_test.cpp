// `moetrain plan` writes its communication model out: each collective's phases (messages ×
// latency + bytes / (link bandwidth / ranks sharing it)), the flat and the hierarchical
// all-to-all side by side, and how many of each a step runs — in the table and in the JSON,
// where the terms must add up to the step's own all-to-all and reduction times.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "support/plan_runs.h"

using namespace moetrain::testing;

namespace {

// DeepSpeed-MoE's 1.3B base with 128 experts over 16 nodes of 8 A100: EP 128 leaves the node.
ProcessResult plan(const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"plan",      "-c", plan_file("deepspeed_moe_1p3b_128e.toml"),
                                   "--cluster", plan_file("dgx_a100_16nodes.toml")};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_moetrain(args, {{"OMP_NUM_THREADS", "1"}}, 60);
}

// A phase's time from its own terms, as the JSON gives them.
double phase_seconds(const nlohmann::json& ph) {
  return ph["messages"].get<double>() * ph["latency_s"].get<double>() +
         ph["bytes"].get<double>() /
             (ph["bandwidth"].get<double>() / ph["sharing"].get<double>());
}

}  // namespace

TEST(PlanComm, TableWritesOutFlatAndHierarchicalAllToAll) {
  const ProcessResult r = plan({});
  ASSERT_EQ(r.code, 0) << r.output();
  const std::string out = r.output();
  EXPECT_NE(out.find("communication, written out"), std::string::npos) << out;
  // 24 layers, every other one MoE: 12 × 4 exchanges. 8 devices share a node's 200 GB/s.
  EXPECT_NE(out.find("all-to-all: 48 exchanges a step"), std::string::npos) << out;
  // Flat: 7 messages within the node and 120 between nodes; 2-D: 7, then 15 (one per other node).
  EXPECT_NE(out.find("+ 7 × 3 µs + 120 × 10 µs"), std::string::npos) << out;
  EXPECT_NE(out.find("then between nodes 15 × 10 µs"), std::string::npos) << out;
  EXPECT_NE(out.find("(200 GB/s / 8 ranks)"), std::string::npos) << out;
  EXPECT_NE(out.find("the run (flat): 48 ×"), std::string::npos) << out;
  EXPECT_NE(out.find("dense gradients over 128 ranks"), std::string::npos) << out;
}

TEST(PlanComm, JsonTermsAddUpToTheStepsCommunication) {
  for (const std::string hierarchical : {"false", "true"}) {
    const ProcessResult r = plan({"--set", "dist.hierarchical=" + hierarchical, "--json"});
    ASSERT_EQ(r.code, 0) << r.output();
    const nlohmann::json j = json_of(r);
    const nlohmann::json& a2a = j["comm"]["a2a"];
    const std::string runs = hierarchical == "true" ? "hierarchical" : "flat";
    EXPECT_EQ(a2a["runs"], runs);
    EXPECT_EQ(j["a2a_kind"], runs);
    for (const char* form : {"flat", "hierarchical"}) {
      const nlohmann::json& c = a2a[form];
      EXPECT_EQ(c["kind"], form);
      ASSERT_EQ(c["phases"].size(), 2u) << c.dump(2);
      // Flat sends within and between nodes at once: latencies add, the slower transfer counts.
      double latency = 0, slowest = 0, serial = 0;
      for (const auto& ph : c["phases"]) {
        latency += ph["latency_part_s"].get<double>();
        slowest = std::max(slowest, ph["transfer_part_s"].get<double>());
        serial += phase_seconds(ph);
      }
      const double expect = c["concurrent"].get<bool>() ? latency + slowest : serial;
      EXPECT_NEAR(c["seconds"].get<double>(), expect, 1e-12) << form;
    }
    EXPECT_TRUE(a2a["flat"]["concurrent"].get<bool>());
    EXPECT_FALSE(a2a["hierarchical"]["concurrent"].get<bool>());
    // Fewer, larger messages between nodes: the 2-D exchange is the faster one here.
    EXPECT_LT(a2a["hierarchical"]["seconds"].get<double>(), a2a["flat"]["seconds"].get<double>());
    const double each = a2a[runs]["seconds"].get<double>() + a2a["late_s"].get<double>();
    EXPECT_NEAR(a2a["exchanges_per_step"].get<double>() * each, j["parts"]["a2a_s"].get<double>(),
                1e-9 * j["parts"]["a2a_s"].get<double>());
    double reductions = 0;
    for (const auto& red : j["comm"]["reductions"]) reductions += red["seconds"].get<double>();
    EXPECT_NEAR(reductions, j["parts"]["grad_sync_s"].get<double>(), 1e-12);
  }
}
