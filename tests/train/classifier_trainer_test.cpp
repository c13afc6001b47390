// The classifier trainer on the real Fashion-MNIST files: accuracy on the t10k set, bitwise
// reproducible runs, checkpoints that load back, deterministic batches, configs that name the key.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/timer.h"
#include "io/checkpoint.h"
#include "support/image_rows.h"
#include "support/temp_dir.h"
#include "train/classifier_config.h"
#include "train/classifier_trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

// The 10000 t10k images: a sixth of the training set's decompression, enough for the small runs.
const ImageDataset& t10k() {
  static const ImageDataset data = load_fashion_mnist("t10k");
  return data;
}

// Small disjoint training and test sets, for runs that check mechanics rather than accuracy.
ClassifierData small_data() {
  return {image_rows(t10k(), 0, 3000), image_rows(t10k(), 3000, 500)};
}

ClassifierRunConfig small_run(const TempDir& tmp, std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"model.dim=32",
                                "model.n_layers=2",
                                "model.expert_hidden=32",
                                "model.n_experts=4",
                                "model.top_k=2",
                                "train.steps=24",
                                "train.batch_size=32",
                                "train.eval_every=10",
                                "train.eval_batch_size=128",
                                "train.progress=off",
                                "optim.warmup_steps=4",
                                "train.threads=1",
                                "train.run_dir=" + (tmp / "run").string()};
  o.insert(o.end(), extra.begin(), extra.end());
  return load_classifier_config("", o);
}

// metrics.jsonl without the wall-clock fields: what must be reproducible bit for bit.
std::vector<nlohmann::json> metrics(const fs::path& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    for (const char* key : {"step_time_s", "images_per_s", "compute_s", "comm_total_s",
                            "comm_exposed_s", "comm_efficiency", "overlap_ratio", "rss_bytes",
                            "peak_rss_bytes", "peak_rss_bytes_max"})
      j.erase(key);
    out.push_back(j);
  }
  return out;
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error for " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A run of `extra` straight through in a, and the same run stopped at step `stop` (a checkpoint,
// as if interrupted) and resumed in b: each one's final parameters and reproducible metrics.
struct StraightAndResumed {
  std::vector<float> straight, resumed;
  std::vector<nlohmann::json> straight_metrics, resumed_metrics;
};
StraightAndResumed straight_and_resumed(const TempDir& a, const TempDir& b,
                                        const std::vector<std::string>& extra, int64_t stop,
                                        const ClassifierData& data) {
  StraightAndResumed out;
  {
    ClassifierTrainer t(small_run(a, extra), data);
    t.run();
    out.straight = t.params();
  }
  {
    ClassifierTrainer t(small_run(b, extra), data);
    ClassifierTrainResult r = t.run(stop);
    EXPECT_EQ(r.steps_done, stop);
    EXPECT_EQ(r.last_checkpoint.filename(), fmt::format("step_{:08d}", stop));
  }
  {
    ClassifierTrainer t(small_run(b, extra), data, /*resume=*/true);
    EXPECT_EQ(t.step(), stop);
    ClassifierTrainResult r = t.run();
    EXPECT_EQ(r.steps_done, t.total_steps() - stop);
    out.resumed = t.params();
  }
  EXPECT_EQ(out.straight.size(), out.resumed.size());
  EXPECT_EQ(0, std::memcmp(out.straight.data(), out.resumed.data(),
                           std::min(out.straight.size(), out.resumed.size()) * sizeof(float)));
  out.straight_metrics = metrics(a / "run");
  out.resumed_metrics = metrics(b / "run");
  EXPECT_EQ(out.straight_metrics.size(), out.resumed_metrics.size());
  for (size_t i = 0; i < std::min(out.straight_metrics.size(), out.resumed_metrics.size()); ++i)
    EXPECT_EQ(out.straight_metrics[i].dump(), out.resumed_metrics[i].dump()) << "line " << i;
  return out;
}

}  // namespace

// The shipped configuration's model and optimizer, trained for fewer steps, must reach 85% on the
// 10000 test images (the full config reaches about 88% in 1500 steps).
TEST(ClassifierTrainer, ReachesEightyFivePercentOnFashionMnistTest) {
  TempDir tmp("fmnist");
  // One thread: the result is the same for any thread count, and a single thread never waits at a
  // barrier for a peer that a busy machine has descheduled (two threads run 10x slower then).
  ClassifierRunConfig cfg =
      load_classifier_config(std::string(MOETRAIN_SOURCE_DIR) + "/configs/fashion_mnist.toml",
                             {"train.steps=800", "train.eval_every=0", "train.progress=off",
                              "train.threads=1", "train.run_dir=" + (tmp / "run").string()});
  Timer timer;
  ClassifierTrainer trainer(cfg);  // the real training set, from data.dir
  ClassifierTrainResult r = trainer.run();
  EXPECT_EQ(r.steps_done, 800);
  EXPECT_GE(r.test_accuracy, 0.85) << "test accuracy after 800 steps";
  std::printf("test accuracy %.2f%% after %lld steps in %.1f s (%.0f images/s)\n",
              100 * r.test_accuracy, static_cast<long long>(r.steps_done), timer.seconds(),
              r.images_per_s);
  // The final evaluation is the last line of the metrics, over every test image.
  auto m = metrics(cfg.train.run_dir);
  ASSERT_EQ(m.size(), 801u);
  EXPECT_EQ(m.back()["step"], 800);
  EXPECT_DOUBLE_EQ(m.back()["test_accuracy"].get<double>(), r.test_accuracy);
}

TEST(ClassifierTrainer, SameSeedGivesBitwiseIdenticalMetricsForAnyThreadCount) {
  TempDir a_dir("same_a"), b_dir("same_b"), c_dir("same_c");
  std::vector<float> pa, pb;
  ClassifierRunConfig a = small_run(a_dir), b = small_run(b_dir, {"train.threads=2"});
  {
    ClassifierTrainer t(a, small_data());
    t.run();
    pa = t.params();
  }
  {
    ClassifierTrainer t(b, small_data());
    t.run();
    pb = t.params();
  }
  auto ma = metrics(a.train.run_dir), mb = metrics(b.train.run_dir);
  ASSERT_EQ(ma.size(), 24u + 3u);  // 24 steps, evaluations at 10, 20 and the end
  ASSERT_EQ(ma.size(), mb.size());
  for (size_t i = 0; i < ma.size(); ++i) EXPECT_EQ(ma[i].dump(), mb[i].dump()) << "line " << i;
  ASSERT_EQ(pa.size(), pb.size());
  EXPECT_EQ(0, std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(float)));
  // Steps 1-10, evaluation, steps 11-20, evaluation, steps 21-24, final evaluation.
  EXPECT_EQ(ma[10]["step"], 10);
  EXPECT_TRUE(ma[10].contains("test_accuracy"));
  EXPECT_EQ(ma[25]["step"], 24);
  EXPECT_LT(ma[25]["loss"].get<double>(), ma[0]["loss"].get<double>());
  // Each step line has what the LM trainer's has, plus the batch accuracy.
  for (const char* key : {"loss", "ce", "aux", "z", "accuracy", "lr", "grad_norm",
                          "tokens_per_expert", "dropped_fraction", "imbalance"})
    EXPECT_TRUE(ma[0].contains(key)) << key;
  EXPECT_EQ(ma[0]["tokens_per_expert"].size(), 2u);

  // Another seed: other batches, other initial weights, other numbers.
  ClassifierRunConfig c = small_run(c_dir, {"train.seed=99"});
  {
    ClassifierTrainer t(c, small_data());
    t.run();
  }
  EXPECT_NE(metrics(c.train.run_dir)[0].dump(), ma[0].dump());
}

TEST(ClassifierTrainer, CheckpointHoldsTheClassifierAndLoadsBack) {
  TempDir tmp("ckpt");
  // sigmoid_bias: the router biases are checkpoint state; a shared expert too.
  ClassifierRunConfig cfg =
      small_run(tmp, {"model.router=sigmoid_bias", "model.shared_expert_hidden=16",
                      "train.steps=12", "train.eval_every=0"});
  ClassifierData data = small_data();
  ClassifierTrainResult r;
  std::vector<float> params;
  std::vector<float> bias;
  {
    ClassifierTrainer t(cfg, data);
    r = t.run();
    params = t.params();
    const float* b = t.model().moe_layers()[1]->router_bias();
    bias.assign(b, b + cfg.model.n_experts);
  }
  EXPECT_EQ(r.last_checkpoint.filename(), "step_00000012");
  auto latest = find_latest_checkpoint(cfg.train.run_dir);
  ASSERT_TRUE(latest);
  EXPECT_EQ(*latest, r.last_checkpoint);
  for (const char* f :
       {"model.safetensors", "optimizer.safetensors", "state.safetensors", "config.json"})
    EXPECT_TRUE(fs::is_regular_file(r.last_checkpoint / f)) << f;
  auto config = read_checkpoint_json(r.last_checkpoint, "config.json");
  EXPECT_EQ(config["model_type"], "moe_classifier");
  EXPECT_EQ(config["moetrain"]["model"]["router"], "sigmoid_bias");
  EXPECT_EQ(config["moetrain"]["train"]["steps"], 12);
  // The parameters under the classifier's names, read back by a plain checkpoint reader.
  std::vector<float> w(32 * 784), head_w(10 * 32);
  CheckpointContents c;
  c.model = {{"model.input_proj.weight", {32, 784}, w.data()},
             {"classifier.weight", {10, 32}, head_w.data()}};
  read_checkpoint(r.last_checkpoint, c);
  EXPECT_EQ(c.trainer["step"], 12);

  LoadedClassifier m = load_classifier(cfg.train.run_dir);
  EXPECT_EQ(m.step, 12);
  ASSERT_EQ(m.params.size(), params.size());
  EXPECT_EQ(0, std::memcmp(m.params.data(), params.data(), params.size() * sizeof(float)));
  const ClassifierLayout& layout = m.model->layout();
  EXPECT_EQ(0, std::memcmp(w.data(), params.data() + layout.input_proj, w.size() * sizeof(float)));
  EXPECT_EQ(0,
            std::memcmp(head_w.data(), params.data() + layout.head, head_w.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(bias.data(), m.model->moe_layers()[1]->router_bias(),
                           bias.size() * sizeof(float)));
  ClassifierEval ev =
      evaluate_classifier(*m.model, m.params.data(), *data.test, cfg.train.eval_batch_size);
  EXPECT_EQ(ev.accuracy, r.test_accuracy);
  EXPECT_EQ(ev.loss, r.test_loss);

  // A rerun in the same directory replaces the earlier run's checkpoints and metrics.
  cfg.train.steps = 5;
  {
    ClassifierTrainer t(cfg, data);
    t.run();
  }
  EXPECT_EQ(find_latest_checkpoint(cfg.train.run_dir)->filename(), "step_00000005");
  EXPECT_FALSE(fs::exists(r.last_checkpoint));
  EXPECT_EQ(metrics(cfg.train.run_dir).size(), 6u);
}

TEST(ClassifierTrainer, ResumeIsBitExact) {
  // Stopped at step 7 (a checkpoint, as if interrupted) and resumed: the same metrics, parameters
  // and router biases as the uninterrupted run, bit for bit.
  TempDir a("straight"), b("resumed");
  const std::vector<std::string> extra = {"model.router=sigmoid_bias", "train.steps=16",
                                          "train.eval_every=5", "train.checkpoint_every=3"};
  ClassifierData data = small_data();
  straight_and_resumed(a, b, extra, 7, data);

  // Another configuration does not resume this run's checkpoint.
  expect_error(
      [&] {
        ClassifierTrainer t(small_run(b, {"model.router=sigmoid_bias", "train.batch_size=16"}),
                            data, /*resume=*/true);
      },
      "different configuration");
}

TEST(ClassifierTrainer, DynamicCapacityAndTheRlControllerRunThroughTheOneEngine) {
  // The classifier steps through the LM's step engine, so its controllers are the LM's: the
  // dynamic capacity factor moves, is recorded each step and resumes bit for bit.
  TempDir a("dyn_straight"), b("dyn_resumed");
  const std::vector<std::string> dynamic = {
      "model.capacity=dynamic", "model.capacity_factor=1.5", "train.steps=12",
      "train.eval_every=0",
      // Thresholds that make the rules fire on this small model: the factor moves every step.
      "balance.window=3", "balance.util_low=0.97", "balance.util_high=0.99",
      "balance.imbalance_high=1.0", "balance.imbalance_low=1.0"};
  ClassifierData data = small_data();
  const std::vector<nlohmann::json> ma =
      straight_and_resumed(a, b, dynamic, 5, data).straight_metrics;
  int changes = 0;
  for (size_t i = 0; i < ma.size(); ++i) {
    if (!ma[i].contains("loss")) continue;
    ASSERT_TRUE(ma[i].contains("capacity_factor")) << ma[i].dump();
    ASSERT_EQ(ma[i]["capacity_factor"].size(), 2u);  // one per MoE block
    if (i > 0 && ma[i - 1].contains("capacity_factor"))
      changes += ma[i]["capacity_factor"] != ma[i - 1]["capacity_factor"];
  }
  EXPECT_EQ(ma[0]["capacity_factor"], nlohmann::json::array({1.5, 1.5}));
  EXPECT_GT(changes, 0) << "the controller never moved the factor";

  // The RL gating controller steers the sigmoid_bias router: each step records its rewards.
  TempDir c("rl");
  ClassifierTrainer t(small_run(c, {"model.router=sigmoid_bias", "model.router_controller=rl",
                                    "train.steps=4", "train.eval_every=0"}),
                      data);
  EXPECT_EQ(t.run().steps_done, 4);
  const std::vector<nlohmann::json> mc = metrics(c / "run");
  ASSERT_FALSE(mc.empty());
  EXPECT_EQ(mc[0]["gating_reward"], nlohmann::json::array({0.0, 0.0}));  // no action yet
  for (const auto& line : mc) {
    if (line.contains("loss")) {
      EXPECT_TRUE(line.contains("gating_reward")) << line.dump();
    }
  }
}

TEST(ClassifierTrainer, EpochsSetTheRunLength) {
  TempDir tmp("epochs");
  ClassifierRunConfig cfg =
      small_run(tmp, {"train.steps=0", "train.epochs=1", "train.batch_size=256",
                      "train.eval_every=0", "model.dim=16", "model.expert_hidden=16"});
  ClassifierTrainer t(cfg, small_data());
  EXPECT_EQ(t.total_steps(), 12);  // ceil(3000 / 256)
  ClassifierTrainResult r = t.run();
  EXPECT_EQ(r.steps_done, 12);
}

TEST(EpochSampler, EveryEpochIsAPermutationDrawnFromSeedAndEpoch) {
  const int64_t n = 103, B = 10;
  EpochSampler s(n, 7);
  for (int64_t e = 0; e < 3; ++e) {
    std::vector<int64_t> p = s.epoch(e);
    std::set<int64_t> seen(p.begin(), p.end());
    EXPECT_EQ(seen.size(), size_t(n));
    EXPECT_EQ(*seen.begin(), 0);
    EXPECT_EQ(*seen.rbegin(), n - 1);
  }
  EXPECT_NE(s.epoch(0), s.epoch(1));
  EXPECT_NE(s.epoch(0), EpochSampler(n, 8).epoch(0));
  // Steps walk through the epochs end to end; step 10 straddles epochs 0 and 1.
  std::vector<int64_t> rows(B);
  EpochSampler fresh(n, 7);
  std::vector<int64_t> e0 = fresh.epoch(0), e1 = fresh.epoch(1);
  s.batch(10, B, rows.data());
  for (int64_t b = 0; b < B; ++b)
    EXPECT_EQ(rows[b], 100 + b < n ? e0[100 + b] : e1[100 + b - n]) << b;
  // A pure function of (seed, step): the order steps are asked in does not matter.
  std::vector<int64_t> later(B), again(B);
  s.batch(25, B, later.data());
  EpochSampler other(n, 7);
  other.batch(25, B, again.data());
  EXPECT_EQ(later, again);
  EXPECT_THROW(EpochSampler(0, 1), Error);
}

TEST(ClassifierConfig, BadKeysAndValuesNameTheKey) {
  TempDir tmp("cfg");
  expect_error([&] { load_classifier_config(tmp.write("a.toml", "[model]\ndimm = 3\n").string()); },
               "model.dimm");
  expect_error(
      [&] { load_classifier_config(tmp.write("b.toml", "[train]\nsteps = 1.5\n").string()); },
      "key 'train.steps' must be an integer");
  expect_error([&] { load_classifier_config(tmp.write("c.toml", "[modle]\ndim = 3\n").string()); },
               "unknown section [modle]; sections are [model], [data], [optim], [train]");
  expect_error([&] { load_classifier_config(tmp.write("d.toml", "[train\n").string()); },
               "d.toml:1");
  expect_error([&] { load_classifier_config(tmp.write("e.toml", "seed = 3\n").string()); },
               "key 'seed' must be inside a section");
  // Keys of the LM's config that the classifier does not have.
  expect_error([&] { load_classifier_config("", {"model.n_heads=4"}); },
               "unknown key 'model.n_heads'");
  expect_error([&] { load_classifier_config("", {"train.seq_len=4"}); }, "train.seq_len");
  expect_error([&] { load_classifier_config("", {"train.batch_size=many"}); },
               "train.batch_size=many");
  expect_error([&] { load_classifier_config("", {"model.top_k=9"}); }, "model.top_k = 9");
  expect_error([&] { load_classifier_config("", {"model.capacity=dynamic"}); },
               "model.capacity = dynamic needs model.capacity_factor ≠ 0");
  expect_error([&] { load_classifier_config("", {"model.router_controller=rl"}); },
               "model.router_controller = rl needs model.router = sigmoid_bias");
  expect_error([&] { load_classifier_config("", {"model.router=switch"}); },
               "model.router = 'switch'");
  expect_error([&] { load_classifier_config("", {"train.epochs=2"}); },
               "train.epochs = 2 and train.steps = 1500");
  expect_error([&] { load_classifier_config("", {"train.eval_batch_size=0"}); },
               "train.eval_batch_size = 0");
  expect_error([&] { load_classifier_config("", {"optim.name=adam"}); },
               "adamw, sgd, adagrad, rmsprop");
  expect_error([&] { load_classifier_config("", {"optim.lr=-1"}); }, "optim.lr = -1");
  expect_error([&] { load_classifier_config("", {"train.progress=loud"}); },
               "train.progress = 'loud'");
  expect_error([&] { load_classifier_config("/no/such/file.toml"); }, "/no/such/file.toml");
  // Data that does not fit the model names the key.
  expect_error([&] { ClassifierTrainer t(small_run(tmp, {"model.input_dim=100"}), small_data()); },
               "model.input_dim = 100");
  expect_error(
      [&] { ClassifierTrainer t(small_run(tmp, {"data.dir=" + (tmp / "none").string()})); },
      "data.dir");

  ClassifierRunConfig ok =
      load_classifier_config("", {"model.dim=64", "optim.lr=0.01", "model.input_bias=false"});
  EXPECT_EQ(ok.model.dim, 64);
  EXPECT_DOUBLE_EQ(ok.optim.lr, 0.01);
  EXPECT_FALSE(ok.model.input_bias);
  ClassifierRunConfig round = classifier_config_from_json(ok.to_json(), "test");
  EXPECT_EQ(round.to_json(), ok.to_json());
  expect_error(
      [&] {
        classifier_config_from_json({{"model", {{"dim", "big"}}}}, "x.json");
      },
      "key 'model.dim' must be an integer");
  EXPECT_EQ(classifier_config_keys().front(), "model.input_dim");
}

TEST(ClassifierConfig, ShippedConfigLoads) {
  ClassifierRunConfig c =
      load_classifier_config(std::string(MOETRAIN_SOURCE_DIR) + "/configs/fashion_mnist.toml");
  EXPECT_EQ(c.model.input_dim, 784);
  EXPECT_EQ(c.model.n_classes, 10);
  EXPECT_GT(c.model.n_experts, 1);
  EXPECT_EQ(c.optim.name, "adamw");
  EXPECT_EQ(c.data.dir, kFashionMnistDir);
}

TEST(ClassifierTrainer, SecondRunOnAHeldRunDirectoryStopsAndRemovesNothing) {
  TempDir tmp("cls_lock");
  ClassifierRunConfig cfg = small_run(tmp, {"train.steps=2", "train.checkpoint_every=1"});
  ClassifierData data = small_data();
  ClassifierTrainer first(cfg, data);
  first.run();
  ASSERT_TRUE(fs::is_directory(tmp / "run" / "checkpoints"));
  // A fresh run would remove the earlier run's checkpoints: it must stop before that.
  expect_error([&] { ClassifierTrainer second(cfg, data); },
               "in use by pid " + std::to_string(::getpid()));
  EXPECT_TRUE(find_latest_checkpoint(tmp / "run").has_value());
}
