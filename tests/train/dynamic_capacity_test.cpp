// model.capacity = dynamic end to end: the factor in effect is recorded each step, the
// controller's state resumes bit-exactly, and bad [balance] settings name their key.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "support/corpus.h"
#include "support/expect_error.h"
#include "support/small_run.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/step_metrics.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> dynamic_keys(const TempDir& tmp) {
  std::vector<std::string> keys = small_run_keys(tmp);
  keys.insert(keys.end(), {"model.capacity=dynamic", "model.capacity_factor=1.5",
                           // Thresholds that make the rules fire on this small model: the
                           // factor moves every step.
                           "balance.window=3", "balance.util_low=0.97", "balance.util_high=0.99",
                           "balance.imbalance_high=1.0", "balance.imbalance_low=1.0",
                           "train.grad_accum=2"});
  return keys;
}

RunConfig dynamic_run(const TempDir& tmp) {
  write_corpus(tmp / "data", 60000);
  return load_run_config("", dynamic_keys(tmp));
}

std::vector<nlohmann::json> step_lines(const fs::path& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j);
  }
  return out;
}

void expect_error(const TempDir& tmp, const std::string& set, const char* needle) {
  std::vector<std::string> keys = dynamic_keys(tmp);
  keys.push_back(set);
  moetrain::testing::expect_error([&] { load_run_config("", keys); }, needle);
}

}  // namespace

TEST(DynamicCapacity, FactorInEffectIsRecordedAndResumesBitExactly) {
  TempDir straight_dir("straight"), resumed_dir("resumed");
  RunConfig a = dynamic_run(straight_dir), b = dynamic_run(resumed_dir);
  std::vector<float> straight, resumed;
  {
    Trainer t(a, false);
    t.run();
    straight = t.params();
  }
  {
    Trainer t(b, false);
    t.run(4);
  }
  {
    Trainer t(b, true);
    ASSERT_EQ(t.step(), 4);
    t.run();
    resumed = t.params();
  }
  const auto la = step_lines(a.train.run_dir), lb = step_lines(b.train.run_dir);
  ASSERT_EQ(la.size(), 8u);
  ASSERT_EQ(lb.size(), 8u);
  // Step 1 runs at the configured factor; later steps at what the controller chose.
  EXPECT_EQ(la[0]["capacity_factor"], nlohmann::json::array({1.5, 1.5}));
  int changes = 0;
  for (std::size_t s = 0; s < la.size(); ++s) {
    ASSERT_EQ(la[s]["capacity_factor"].size(), 2u);
    for (const auto& cf : la[s]["capacity_factor"]) {
      EXPECT_GE(cf.get<double>(), 0.5 - 1e-6);
      EXPECT_LE(cf.get<double>(), 2.0 + 1e-6);
    }
    if (s > 0) changes += la[s]["capacity_factor"] != la[s - 1]["capacity_factor"];
    EXPECT_EQ(la[s]["loss"], lb[s]["loss"]) << "step " << s + 1;
    EXPECT_EQ(la[s]["capacity_factor"], lb[s]["capacity_factor"]) << "step " << s + 1;
    EXPECT_EQ(la[s]["capacity_utilisation"], lb[s]["capacity_utilisation"]) << "step " << s + 1;
    for (const char* key : {"load_entropy", "rank_max_mean_load", "capacity_utilisation"})
      EXPECT_EQ(la[s][key].size(), 2u) << key;
  }
  EXPECT_GT(changes, 0) << "the controller never moved the factor: the test checks nothing";
  ASSERT_EQ(straight.size(), resumed.size());
  EXPECT_EQ(0, std::memcmp(straight.data(), resumed.data(), straight.size() * sizeof(float)))
      << "parameters differ after resume";
}

TEST(DynamicCapacity, BadSettingsNameTheKey) {
  TempDir tmp("bad");
  expect_error(tmp, "model.capacity=adaptive", "model.capacity = 'adaptive'");
  expect_error(tmp, "balance.cf_min=3", "balance.cf_max");
  expect_error(tmp, "balance.cf_min=0", "balance.cf_min");
  expect_error(tmp, "balance.window=1", "balance.window");
  expect_error(tmp, "model.capacity_factor=0", "model.capacity_factor");
  expect_error(tmp, "model.router=expert_choice", "model.router");
}

TEST(LoadMetrics, EntropyRankLoadsAndUtilisation) {
  EXPECT_DOUBLE_EQ(load_entropy({5, 5, 5, 5}), 1.0);
  EXPECT_DOUBLE_EQ(load_entropy({9, 0, 0, 0}), 0.0);
  EXPECT_DOUBLE_EQ(load_entropy({0, 0, 0, 0}), 0.0);
  // Two of four experts equally loaded: ln 2 / ln 4.
  EXPECT_NEAR(load_entropy({3, 0, 3, 0}), 0.5, 1e-15);
  EXPECT_EQ(rank_loads({1, 2, 3, 4}, 2), (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(rank_loads({1, 2, 3, 4}, 1), (std::vector<int64_t>{10}));
  EXPECT_DOUBLE_EQ(imbalance(rank_loads({1, 2, 3, 4}, 2)), 1.4);  // 7 over the mean 5
  Accumulated acc;
  acc.capacity_slots = {40, 0};
  acc.computed = {30, 12};
  EXPECT_DOUBLE_EQ(capacity_utilisation(acc, 0), 0.75);
  EXPECT_DOUBLE_EQ(capacity_utilisation(acc, 1), 1.0);
}
