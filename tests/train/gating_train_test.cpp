// model.router_controller = rl end to end: the controller steers the bias every step, records
// its reward, checkpoints its state per MoE layer, and bad settings name their key.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/checkpoint.h"
#include "io/crc32c.h"
#include "support/corpus.h"
#include "support/expect_error.h"
#include "support/resign.h"
#include "support/small_run.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> rl_keys(const TempDir& tmp) {
  std::vector<std::string> keys = small_run_keys(tmp);
  keys.insert(keys.end(),
              {"model.router=sigmoid_bias", "model.router_controller=rl", "train.grad_accum=1"});
  return keys;
}

void expect_error(const TempDir& tmp, const std::string& set, const char* needle) {
  std::vector<std::string> keys = rl_keys(tmp);
  keys.push_back(set);
  moetrain::testing::expect_error([&] { load_run_config("", keys); }, needle);
}


}  // namespace

TEST(GatingTrain, SteersTheBiasRecordsRewardsAndCheckpointsItsState) {
  TempDir tmp("rl");
  write_corpus(tmp / "data", 60000);
  const RunConfig cfg = load_run_config("", rl_keys(tmp));
  {
    Trainer t(cfg, false);
    t.run(4);
    const float* b = t.model().moe_layers()[0]->router_bias();
    // The sign rule moves every bias by exactly ±γ or 0 per step; the policy's Gaussian actions
    // leave values off that grid.
    bool off_grid = false;
    for (int e = 0; e < 4; ++e) {
      const double steps = b[e] / 1e-3;
      off_grid |= std::abs(steps - std::round(steps)) > 1e-2;
    }
    EXPECT_TRUE(off_grid) << "the bias moved like the sign rule";
  }
  std::vector<nlohmann::json> lines;
  std::ifstream in(fs::path(cfg.train.run_dir) / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) lines.push_back(j);
  }
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0]["gating_reward"], nlohmann::json::array({0.0, 0.0}));  // no action yet
  for (std::size_t s = 1; s < lines.size(); ++s) {
    ASSERT_EQ(lines[s]["gating_reward"].size(), 2u);
    for (const auto& r : lines[s]["gating_reward"]) EXPECT_GT(r.get<double>(), 0.0);
  }

  const fs::path dir = checkpoint_dir(cfg.train.run_dir, 4);
  nlohmann::json state = read_checkpoint_json(dir, "trainer_state.json");
  ASSERT_TRUE(state.contains("gating_controller"));
  ASSERT_EQ(state["gating_controller"].size(), 2u);
  EXPECT_EQ(state["gating_controller"][0]["action"].size(), 4u);
  {
    Trainer resumed(cfg, true);  // the state as written loads
    EXPECT_EQ(resumed.step(), 4);
  }
  state["gating_controller"].erase(1);
  resign_checkpoint_file(dir, "trainer_state.json", state.dump(2));
  try {
    Trainer resumed(cfg, true);
    FAIL() << "resumed without the second layer's controller state";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'gating_controller' must hold one state per MoE layer"),
              std::string::npos)
        << e.what();
  }
}

TEST(GatingTrain, BadSettingsNameTheKey) {
  TempDir tmp("bad");
  expect_error(tmp, "model.router_controller=ppo", "model.router_controller = 'ppo'");
  expect_error(tmp, "model.router=topk_softmax", "model.router_controller = rl needs");
  expect_error(tmp, "gating.sigma=0", "gating.sigma");
  expect_error(tmp, "gating.baseline_lr=-1", "gating.baseline_lr");
  expect_error(tmp, "gating.time_decay=1", "gating.time_decay");
}
