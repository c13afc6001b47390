// [grad] expert_reweight end to end: every mode trains and moves the run away from none, the
// factor range is recorded per layer, the importance averages resume bit-exactly, and bad
// [grad] settings name their key.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/idx.h"
#include "support/corpus.h"
#include "support/expect_error.h"
#include "support/image_rows.h"
#include "support/small_run.h"
#include "support/temp_dir.h"
#include "train/classifier_config.h"
#include "train/classifier_trainer.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

RunConfig reweight_run(const TempDir& tmp, const std::string& mode) {
  write_corpus(tmp / "data", 60000);
  std::vector<std::string> keys = small_run_keys(tmp);
  // Thresholds close to the mean load, so that the utilisation rule fires on this small model.
  keys.insert(keys.end(), {"grad.expert_reweight=" + mode, "grad.util_low=0.9",
                           "grad.util_high=1.1", "train.grad_accum=2", "train.steps=6"});
  return load_run_config("", keys);
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

std::vector<float> train(const RunConfig& cfg) {
  Trainer t(cfg, false);
  t.run();
  return t.params();
}

}  // namespace

TEST(ExpertReweightTrain, EveryModeTrainsAndDiffersFromNone) {
  TempDir none_dir("none");
  const RunConfig none = reweight_run(none_dir, "none");
  const std::vector<float> base = train(none);
  for (const nlohmann::json& line : step_lines(none.train.run_dir))
    EXPECT_FALSE(line.contains("expert_reweight_min"));
  for (const char* mode : {"importance", "utilisation", "grad_norm"}) {
    TempDir dir(mode);
    const RunConfig cfg = reweight_run(dir, mode);
    const std::vector<float> params = train(cfg);
    ASSERT_EQ(params.size(), base.size());
    EXPECT_NE(0, std::memcmp(params.data(), base.data(), base.size() * sizeof(float)))
        << mode << ": the same parameters as without reweighting";
    const std::vector<nlohmann::json> lines = step_lines(cfg.train.run_dir);
    ASSERT_EQ(lines.size(), 6u) << mode;
    bool moved = false;
    for (const nlohmann::json& line : lines) {
      ASSERT_TRUE(line.contains("expert_reweight_min") && line.contains("expert_reweight_max"))
          << mode;
      const auto lo = line["expert_reweight_min"].get<std::vector<double>>();
      const auto hi = line["expert_reweight_max"].get<std::vector<double>>();
      ASSERT_EQ(lo.size(), 2u) << mode << ": one range per MoE layer";
      ASSERT_EQ(hi.size(), 2u) << mode;
      for (int l = 0; l < 2; ++l) {
        // Mean 1 over the experts: the range straddles 1.
        EXPECT_LE(lo[l], 1.0 + 1e-12) << mode;
        EXPECT_GE(hi[l], 1.0 - 1e-12) << mode;
        moved = moved || hi[l] - lo[l] > 1e-6;
      }
      EXPECT_TRUE(std::isfinite(line["loss"].get<double>())) << mode;
    }
    EXPECT_TRUE(moved) << mode << ": every factor stayed 1";
  }
}

TEST(ExpertReweightTrain, ImportanceResumesBitExactly) {
  TempDir straight_dir("straight"), resumed_dir("resumed");
  const RunConfig a = reweight_run(straight_dir, "importance");
  const std::vector<float> straight = train(a);
  const RunConfig b = reweight_run(resumed_dir, "importance");
  {
    Trainer t(b, false);
    t.run(3);
  }
  std::vector<float> resumed;
  {
    Trainer t(b, true);
    EXPECT_EQ(t.step(), 3);
    t.run();
    resumed = t.params();
  }
  ASSERT_EQ(straight.size(), resumed.size());
  EXPECT_EQ(0, std::memcmp(straight.data(), resumed.data(), straight.size() * sizeof(float)))
      << "parameters differ after resume";
  const auto la = step_lines(a.train.run_dir), lb = step_lines(b.train.run_dir);
  ASSERT_EQ(la.size(), lb.size());
  for (std::size_t i = 0; i < la.size(); ++i) {
    EXPECT_EQ(la[i]["loss"].get<double>(), lb[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(la[i]["expert_reweight_max"], lb[i]["expert_reweight_max"]) << "step " << i + 1;
  }
}

TEST(ExpertReweightTrain, ClassifierReweightsAndResumesBitExactly) {
  const ImageDataset t10k = load_fashion_mnist("t10k");
  auto data = [&] {
    return ClassifierData{image_rows(t10k, 0, 1000), image_rows(t10k, 1000, 200)};
  };
  auto config = [&](const TempDir& tmp, const std::string& mode) {
    return load_classifier_config(
        "", {"model.dim=32", "model.n_layers=2", "model.expert_hidden=32", "model.n_experts=4",
             "model.top_k=2", "train.steps=8", "train.batch_size=32", "train.eval_every=0",
             "train.eval_batch_size=100", "train.progress=off", "optim.warmup_steps=2",
             "train.threads=1", "grad.expert_reweight=" + mode,
             "train.run_dir=" + (tmp / "run").string()});
  };
  TempDir none_dir("c_none"), straight_dir("c_straight"), resumed_dir("c_resumed");
  std::vector<float> base, straight, resumed;
  {
    ClassifierTrainer t(config(none_dir, "none"), data());
    t.run();
    base = t.params();
  }
  {
    ClassifierTrainer t(config(straight_dir, "importance"), data());
    t.run();
    straight = t.params();
  }
  {
    ClassifierTrainer t(config(resumed_dir, "importance"), data());
    t.run(4);
  }
  {
    ClassifierTrainer t(config(resumed_dir, "importance"), data(), true);
    t.run();
    resumed = t.params();
  }
  ASSERT_EQ(base.size(), straight.size());
  EXPECT_NE(0, std::memcmp(base.data(), straight.data(), base.size() * sizeof(float)));
  ASSERT_EQ(straight.size(), resumed.size());
  EXPECT_EQ(0, std::memcmp(straight.data(), resumed.data(), straight.size() * sizeof(float)))
      << "classifier parameters differ after resume";
  const std::vector<nlohmann::json> lines = step_lines(straight_dir / "run");
  ASSERT_FALSE(lines.empty());
  EXPECT_TRUE(lines.back().contains("expert_reweight_max"));
}

TEST(ExpertReweightTrain, BadSettingsNameTheKey) {
  TempDir tmp("bad");
  auto bad = [&](const std::string& set, const char* needle) {
    std::vector<std::string> keys = small_run_keys(tmp);
    keys.push_back(set);
    expect_error([&] { load_run_config("", keys); }, needle);
  };
  bad("grad.expert_reweight=utilization", "grad.expert_reweight = 'utilization'");
  bad("grad.reweight_decay=1", "grad.reweight_decay = 1");
  bad("grad.util_low=-1", "grad.util_low = -1");
  bad("grad.util_high=0.1", "grad.util_high = 0.1");
}
