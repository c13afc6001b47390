// Activation recomputation through the trainer: runs with train.recompute = moe and full (grad
// accumulation, sigmoid_bias updates, dynamic capacity, shared experts, a dense block) give the
// per-step losses and final parameters of the run without recompute, bit for bit, and a run
// resumes under another mode.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/corpus.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

struct Outcome {
  std::vector<double> losses;
  std::vector<float> params;
};

RunConfig config(const TempDir& tmp, const std::string& mode, std::vector<std::string> extra) {
  write_corpus(tmp / "data", 30000);
  std::vector<std::string> o = {
      "model.dim=32", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2",
      "model.expert_hidden=24", "model.n_experts=4", "model.top_k=2", "model.max_seq_len=32",
      "model.dense_every=3", "model.shared_expert_hidden=16", "train.batch_size=2",
      "train.seq_len=32", "train.steps=6", "train.grad_accum=2", "train.eval_every=0",
      "train.eval_batches=1", "train.progress=off", "train.tensorboard=false", "train.threads=1",
      "optim.warmup_steps=2", "train.recompute=" + mode, "data.dir=" + (tmp / "data").string(),
      "train.run_dir=" + (tmp / "run").string()};
  o.insert(o.end(), extra.begin(), extra.end());
  return load_run_config("", o);
}

Outcome train(const std::string& mode, const std::vector<std::string>& extra) {
  TempDir tmp("recompute_" + mode);
  Trainer t(config(tmp, mode, extra), false);
  t.run();
  Outcome out;
  out.params = t.params();
  std::ifstream in(tmp / "run" / "metrics.jsonl");
  for (std::string l; std::getline(in, l);) {
    const auto j = nlohmann::json::parse(l);
    if (j.contains("loss")) out.losses.push_back(j["loss"].get<double>());
  }
  return out;
}

void expect_same(const std::vector<std::string>& extra) {
  const Outcome none = train("none", extra);
  ASSERT_EQ(none.losses.size(), 6u);
  for (const char* mode : {"moe", "full"}) {
    SCOPED_TRACE(mode);
    const Outcome got = train(mode, extra);
    EXPECT_EQ(got.losses, none.losses);
    ASSERT_EQ(got.params.size(), none.params.size());
    EXPECT_EQ(std::memcmp(got.params.data(), none.params.data(), none.params.size() * 4), 0);
  }
}

TEST(RecomputeTrainer, SigmoidBiasBf16SameLossesAndParameters) {
  expect_same({"model.router=sigmoid_bias", "train.precision=bf16"});
}

TEST(RecomputeTrainer, DynamicCapacitySameLossesAndParameters) {
  expect_same({"model.capacity=dynamic", "model.capacity_factor=1.0"});
}

TEST(RecomputeTrainer, ResumesUnderAnotherMode) {
  TempDir tmp("recompute_resume");
  {
    Trainer t(config(tmp, "none", {}), false);
    t.run(3);
  }
  Trainer t(config(tmp, "full", {}), true);
  EXPECT_EQ(t.step(), 3);
  t.run();
  EXPECT_EQ(t.step(), 6);
}

}  // namespace
