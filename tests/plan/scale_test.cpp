// The planner's cost in the size of the model: parameters counted from the shapes (no table of
// named tensors), the experts' load computed once per distinct load row, so a plan costs
// O(layers + experts).
#include <gtest/gtest.h>

#include "model/params.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"

using namespace moetrain;
using namespace moetrain::plan;

namespace {

ParamCounts from_table(const ModelConfig& m) {
  ParamCounts c;
  const ParamLayout layout(m);
  for (const auto& p : layout.params())
    (p.expert >= 0 ? c.expert : c.dense) += static_cast<double>(p.numel);
  return c;
}

// The same per ZeRO-3 unit, cut at the layout's boundaries: the embedding below layers[0].ln1,
// block l in [layers[l].ln1, layers[l + 1].ln1), the head from final_norm on.
std::vector<ParamCounts> units_from_table(const ModelConfig& m) {
  const ParamLayout layout(m);
  std::vector<int64_t> starts = {0};
  for (const auto& o : layout.layers) starts.push_back(o.ln1);
  starts.push_back(layout.final_norm);
  std::vector<ParamCounts> units(starts.size());
  for (const auto& p : layout.params()) {
    const auto unit = std::upper_bound(starts.begin(), starts.end(), p.offset) - starts.begin() - 1;
    (p.expert >= 0 ? units[unit].expert : units[unit].dense) += static_cast<double>(p.numel);
  }
  return units;
}

ModelConfig small_model() {
  ModelConfig m;
  m.vocab_size = 96;
  m.dim = 48;
  m.n_layers = 5;
  m.n_heads = 6;
  m.n_kv_heads = 2;
  m.expert_hidden = 20;
  m.n_experts = 6;
  m.top_k = 2;
  return m;
}

}  // namespace

// The closed form and the trainer's parameter table count the same floats, in all and per ZeRO-3
// unit (cut at the layout's block boundaries), with every optional tensor: dense layers (their
// own hidden size or top_k · F), a shared expert, the noisy router's noise projection,
// grouped-query attention.
TEST(PlanScale, ParameterCountsMatchTheTrainersTable) {
  std::vector<ModelConfig> models;
  models.push_back(small_model());
  ModelConfig dense = small_model();
  dense.dense_every = 2;
  models.push_back(dense);
  ModelConfig sized = dense;
  sized.dense_hidden = 72;
  sized.shared_expert_hidden = 24;
  models.push_back(sized);
  ModelConfig noisy = sized;
  noisy.router = RouterKind::NoisyTopK;
  noisy.n_kv_heads = 6;
  models.push_back(noisy);
  for (const ModelConfig& m : models) {
    const ParamCounts closed = count_params(m), table = from_table(m);
    EXPECT_DOUBLE_EQ(closed.dense, table.dense) << m.dense_every << " " << m.shared_expert_hidden;
    EXPECT_DOUBLE_EQ(closed.expert, table.expert) << m.dense_every << " " << m.shared_expert_hidden;
    const std::vector<ParamCounts> units = unit_params(m), table_units = units_from_table(m);
    ASSERT_EQ(units.size(), static_cast<std::size_t>(m.n_layers + 2));
    ASSERT_EQ(units.size(), table_units.size());
    for (std::size_t u = 0; u < units.size(); ++u) {
      EXPECT_DOUBLE_EQ(units[u].dense, table_units[u].dense) << u << " " << m.dense_every;
      EXPECT_DOUBLE_EQ(units[u].expert, table_units[u].expert) << u << " " << m.dense_every;
    }
  }
}

// A million fine-grained experts on 32 layers: counted from the shapes, and the experts' load
// computed once (the uniform load has one row for every layer). The whole plan, its reference
// run for the communication efficiency included, returns; `moetrain plan` on it takes well under
// a second (docs/plan.md). The parameter counts are exact hand counts.
TEST(PlanScale, AMillionExpertsArePlannedFromTheirShapes) {
  RunConfig cfg;
  ModelConfig& m = cfg.model;
  m.vocab_size = 32768;
  m.dim = 2048;
  m.n_layers = 32;
  m.n_heads = 16;
  m.n_kv_heads = 4;
  m.expert_hidden = 64;
  m.n_experts = 1'000'000;
  m.top_k = 8;
  m.max_seq_len = 4096;
  cfg.train.batch_size = 1;
  cfg.train.seq_len = 4096;
  cfg.train.precision = Precision::BF16;
  const ParamCounts c = count_params(m);
  EXPECT_DOUBLE_EQ(c.expert, 32.0 * 1e6 * 3 * 64 * 2048);
  EXPECT_DOUBLE_EQ(c.dense, 2.0 * 32768 * 2048 + 2048 +
                                32 * (2 * 2048 + 2 * 2048.0 * 2048 + 2 * 512.0 * 2048 +
                                      1e6 * 2048));
  ClusterSpec cluster;
  cluster.device = builtin_device("h100");
  cluster.devices_per_node = 8;
  cluster.nodes = 128;
  cluster.intra_node_bandwidth = 450e9;
  cluster.inter_node_bandwidth = 400e9;
  cluster.intra_node_latency = 3e-6;
  cluster.inter_node_latency = 10e-6;
  const Prediction p = predict(cfg, cluster, {1000, 1000}, uniform_load(m.n_experts));
  EXPECT_GT(p.step_time_s, 0);
  EXPECT_GT(p.parts.experts, 0);
  EXPECT_DOUBLE_EQ(p.imbalance, 1);
}
