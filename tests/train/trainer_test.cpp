// The trainer end to end on real files: bit-exact resume, checkpoints that survive corruption,
// configs that reject bad input.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/check.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "io/checkpoint.h"
#include "io/crc32c.h"
#include "io/safetensors.h"
#include "support/corpus.h"
#include "support/expect_error.h"
#include "support/resign.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

// A step of 2^62 micro-batches would never end (nor let a stop through between steps).
TEST(RunConfigBounds, GradAccumIsBounded) {
  expect_error([] { load_run_config("", {"train.grad_accum=4611686018427387904"}); },
               "train.grad_accum = 4611686018427387904: must be in 1..65536");
  EXPECT_EQ(load_run_config("", {"train.grad_accum=65536"}).train.grad_accum, 65536);
}

RunConfig small_run(const TempDir& tmp, const std::string& router = "topk_softmax",
                    std::size_t corpus_bytes = 60000) {
  write_corpus(tmp / "data", corpus_bytes);
  return load_run_config("", {"model.dim=32",
                              "model.n_layers=2",
                              "model.n_heads=4",
                              "model.n_kv_heads=2",
                              "model.expert_hidden=32",
                              "model.n_experts=4",
                              "model.top_k=2",
                              "model.router=" + router,
                              "model.max_seq_len=32",
                              "train.batch_size=4",
                              "train.seq_len=32",
                              "train.steps=8",
                              "train.grad_accum=2",
                              "train.eval_every=3",
                              "train.eval_batches=2",
                              "train.checkpoint_every=0",
                              "train.progress=off",
                              "optim.warmup_steps=2",
                              "data.dir=" + (tmp / "data").string(),
                              "train.run_dir=" + (tmp / "run").string()});
}

// Per-step training losses from metrics.jsonl, as the exact doubles written.
std::vector<double> step_losses(const fs::path& run_dir) {
  std::vector<double> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

// The run of 8 steps against one stopped at `stop` and resumed.
void expect_bitwise_resume(const std::string& router, std::size_t corpus_bytes = 60000,
                           int64_t stop = 4) {
  TempDir straight_dir("straight"), resumed_dir("resumed");
  RunConfig a = small_run(straight_dir, router, corpus_bytes);
  std::vector<float> straight_params;
  {
    Trainer t(a, false);
    t.run();
    straight_params = t.params();
  }
  RunConfig b = small_run(resumed_dir, router, corpus_bytes);
  {
    Trainer t(b, false);
    t.run(stop);  // stop part way, as if interrupted
  }
  std::vector<float> resumed_params;
  {
    Trainer t(b, true);
    EXPECT_EQ(t.step(), stop);
    t.run();
    resumed_params = t.params();
  }
  auto la = step_losses(a.train.run_dir), lb = step_losses(b.train.run_dir);
  ASSERT_EQ(la.size(), 8u);
  ASSERT_EQ(lb.size(), 8u);
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << router << " step " << i + 1;
  ASSERT_EQ(straight_params.size(), resumed_params.size());
  EXPECT_EQ(0, std::memcmp(straight_params.data(), resumed_params.data(),
                           straight_params.size() * sizeof(float)))
      << router << ": parameters differ after resume";
  EXPECT_LT(la.back(), la.front());
}

}  // namespace

TEST(Trainer, ResumeIsBitExact) {
  expect_bitwise_resume("topk_softmax");
}

TEST(Trainer, ResumeIsBitExactWithRouterBiasState) {
  expect_bitwise_resume("sigmoid_bias");
}

// 1,350 training tokens at T = 32 are 42 windows, 8 a step: the run crosses an epoch's end at
// step 6 (the step takes epoch 0's last 2 windows and epoch 1's first 6), stops inside epoch 1
// and resumes there; the checkpoint says where the data stands.
TEST(Trainer, ResumeIsBitExactAcrossAnEpochsEnd) {
  expect_bitwise_resume("topk_softmax", 1500, 6);
  TempDir tmp("epoch_state");
  RunConfig cfg = small_run(tmp, "topk_softmax", 1500);
  Trainer(cfg, false).run(6);
  const nlohmann::json data =
      read_checkpoint_json(fs::path(cfg.train.run_dir) / "checkpoints" / "latest",
                           "trainer_state.json")["data"];
  EXPECT_EQ(data["next_step"], 6);
  EXPECT_EQ(data["global_batch"], 8);
  EXPECT_EQ(data["windows_per_epoch"], 42);
  EXPECT_EQ(data["next_window"], 48);
  EXPECT_EQ(data["epoch"], 1);
}

TEST(Trainer, CorruptLatestCheckpointFallsBackToThePreviousOne) {
  TempDir tmp("ckpt");
  RunConfig cfg = small_run(tmp);
  cfg.train.checkpoint_every = 2;
  cfg.train.keep_checkpoints = 3;
  {
    Trainer t(cfg, false);
    t.run(6);
  }
  fs::path run = cfg.train.run_dir;
  auto latest = find_latest_checkpoint(run);
  ASSERT_TRUE(latest);
  EXPECT_EQ(latest->filename(), "step_00000006");
  // Flip one byte in the middle of the parameters.
  {
    fs::path p = *latest / "model.safetensors";
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(p) / 2));
    char c = 0;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(fs::file_size(p) / 2));
    c ^= 0x40;
    f.write(&c, 1);
  }
  try {
    verify_checkpoint(*latest);
    FAIL() << "corrupt checkpoint verified";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("CRC-32C"), std::string::npos) << e.what();
  }
  auto fallback = find_latest_checkpoint(run);
  ASSERT_TRUE(fallback);
  EXPECT_EQ(fallback->filename(), "step_00000004");
  // Truncate the optimizer state of step 4 as well: step 2 is next.
  fs::resize_file(*fallback / "optimizer.safetensors", 100);
  EXPECT_THROW(verify_checkpoint(*fallback), Error);
  auto second = find_latest_checkpoint(run);
  ASSERT_TRUE(second);
  EXPECT_EQ(second->filename(), "step_00000002");
  // A directory a writer left before its commit, even a complete-looking one, is never used.
  fs::copy(*second, run / "checkpoints" / ".tmp_step_00000008");
  EXPECT_EQ(find_latest_checkpoint(run), *second);
  {
    Trainer resumed(cfg, true);
    EXPECT_EQ(resumed.step(), 2);
  }  // one run at a time holds the directory
  // An uncommitted checkpoint (no manifest) is never used.
  fs::remove(*second / "manifest.json");
  EXPECT_FALSE(find_latest_checkpoint(run));
  // With every checkpoint refused, --resume stops instead of training from step 0 over them
  // (which would prune them), and leaves them where they are.
  try {
    Trainer again(cfg, true);
    FAIL() << "resumed over checkpoints that all fail verification";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("none can be loaded"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::exists(*second / "model.safetensors"));
  EXPECT_TRUE(fs::exists(*latest / "model.safetensors"));
}

TEST(Trainer, ResumeWithADifferentConfigIsRefused) {
  TempDir tmp("hash");
  RunConfig cfg = small_run(tmp);
  {
    Trainer t(cfg, false);
    t.run(2);
  }
  cfg.optim.lr *= 2;
  try {
    Trainer t(cfg, true);
    FAIL() << "resumed with a different configuration";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("different configuration"), std::string::npos) << e.what();
  }
}

TEST(Trainer, LoadModelMatchesTrainerAndWritesMixtralConfig) {
  TempDir tmp("load");
  RunConfig cfg = small_run(tmp);
  cfg.train.seq_len = 16;
  std::vector<float> params;
  {
    Trainer t(cfg, false);
    t.run(3);
    params = t.params();
  }
  LoadedModel m = load_model(cfg.train.run_dir);
  EXPECT_EQ(m.step, 3);
  // Sampling stays within the context the model was trained on, not the model's limit.
  ASSERT_LT(cfg.train.seq_len, cfg.model.max_seq_len);
  EXPECT_EQ(m.trained_context, cfg.train.seq_len);
  ASSERT_EQ(m.params.size(), params.size());
  EXPECT_EQ(0, std::memcmp(m.params.data(), params.data(), params.size() * sizeof(float)));
  auto j = read_checkpoint_json(*find_latest_checkpoint(cfg.train.run_dir), "config.json");
  EXPECT_EQ(j["model_type"], "mixtral");
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"MixtralForCausalLM"}));
  EXPECT_FALSE(j.contains("moetrain_note"));
  EXPECT_EQ(j["num_local_experts"], 4);
  EXPECT_EQ(j["num_experts_per_tok"], 2);
  EXPECT_EQ(j["hidden_size"], 32);
  // transformers refuses a safetensors file that does not name its framework.
  SafetensorsReader r(*find_latest_checkpoint(cfg.train.run_dir) / "model.safetensors");
  EXPECT_EQ(r.metadata().at("format"), "pt");
}

// The router biases of a sigmoid_bias run are the checkpoint's state: a loaded model (eval,
// sample, forward) routes with the biases the run learned, not with zeros.
TEST(Trainer, LoadModelRoutesWithTheLearnedRouterBiases) {
  TempDir tmp("load_bias");
  RunConfig cfg = small_run(tmp, "sigmoid_bias");
  std::vector<std::vector<float>> learned;
  {
    Trainer t(cfg, false);
    t.run(4);
    for (MoeLayer* m : t.model().moe_layers())
      learned.emplace_back(m->router_bias(), m->router_bias() + cfg.model.n_experts);
  }
  ASSERT_FALSE(learned.empty());
  bool moved = false;
  for (const auto& b : learned)
    for (float v : b) moved = moved || v != 0.0f;
  ASSERT_TRUE(moved) << "four steps of the bias rule left every bias at zero";
  LoadedModel m = load_model(cfg.train.run_dir);
  const std::vector<MoeLayer*> layers = m.model->moe_layers();
  ASSERT_EQ(layers.size(), learned.size());
  for (std::size_t l = 0; l < layers.size(); ++l)
    EXPECT_EQ(std::vector<float>(layers[l]->router_bias(),
                                 layers[l]->router_bias() + cfg.model.n_experts),
              learned[l])
        << "MoE layer " << l;
}

TEST(Trainer, MoetrainOnlyModelDoesNotClaimMixtral) {
  TempDir tmp("shared");
  RunConfig cfg = small_run(tmp);
  cfg.model.shared_expert_hidden = 16;
  {
    Trainer t(cfg, false);
    t.run(1);
  }
  auto j = read_checkpoint_json(*find_latest_checkpoint(cfg.train.run_dir), "config.json");
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"MoetrainForCausalLM"}));
  EXPECT_EQ(j["model_type"], "moetrain");
  EXPECT_NE(j.value("moetrain_note", "").find("shared experts"), std::string::npos) << j.dump(2);
  LoadedModel m = load_model(cfg.train.run_dir);  // still ours to load
  EXPECT_EQ(m.config.model.shared_expert_hidden, 16);
}

TEST(Trainer, MissingDataIsAClearError) {
  TempDir tmp("nodata");
  RunConfig cfg = small_run(tmp);
  cfg.data.dir = (tmp / "nowhere").string();
  try {
    Trainer t(cfg, false);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("moetrain prepare"), std::string::npos) << e.what();
  }
}

// A validation split too small for one window (empty, or seq_len tokens) is refused at start,
// naming the file, its size and train.seq_len, before any training it would waste.
TEST(Trainer, TooSmallValidationSplitIsRefusedAtStart) {
  TempDir tmp("smallval");
  RunConfig cfg = small_run(tmp);
  const fs::path val = tmp / "data" / "val.bin";
  for (uint64_t n : {uint64_t{0}, uint64_t{32}}) {
    std::vector<uint16_t> tokens(n, 65);
    write_token_shard(val, tokens.data(), n, 256);
    try {
      Trainer t(cfg, false);
      FAIL() << "started with " << n << " validation tokens";
    } catch (const Error& e) {
      const std::string want =
          fmt::format("{} has {} tokens, too few for train.seq_len = 32", val.string(), n);
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(tmp / "run" / "metrics.jsonl"));
  }
}

TEST(RunConfig, UnknownKeysAndBadValuesNameTheKey) {
  TempDir tmp("cfg");
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      FAIL() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  fs::path bad_key = tmp.write("a.toml", "[model]\ndimm = 3\n");
  expect_error([&] { load_run_config(bad_key.string()); }, "model.dimm");
  fs::path bad_type = tmp.write("b.toml", "[model]\ndim = \"big\"\n");
  expect_error([&] { load_run_config(bad_type.string()); }, "must be an integer");
  fs::path bad_section = tmp.write("c.toml", "[modle]\ndim = 3\n");
  expect_error([&] { load_run_config(bad_section.string()); }, "modle");
  fs::path syntax = tmp.write("d.toml", "[model\n");
  expect_error([&] { load_run_config(syntax.string()); }, "d.toml:1");
  expect_error([&] { load_run_config("", {"optim.name=adam"}); }, "adamw, sgd, adagrad, rmsprop");
  expect_error([&] { load_run_config("", {"train.steps=ten"}); }, "train.steps=ten");
  expect_error([&] { load_run_config("", {"model.router=switch"}); }, "switch");
  expect_error([&] { load_run_config("/no/such/file.toml"); }, "/no/such/file.toml");
  RunConfig ok = load_run_config("", {"model.dim=64", "optim.lr=0.01", "model.renormalize=false"});
  EXPECT_EQ(ok.model.dim, 64);
  EXPECT_DOUBLE_EQ(ok.optim.lr, 0.01);
  EXPECT_FALSE(ok.model.renormalize);
  RunConfig round = run_config_from_json(ok.to_json(), "test");
  EXPECT_EQ(round.to_json(), ok.to_json());
  EXPECT_EQ(round.config_hash(), ok.config_hash());
}

TEST(RunConfig, ShippedConfigsLoad) {
  for (const char* name : {"tiny.toml", "ablation/model.toml"}) {
    RunConfig c = load_run_config(std::string(MOETRAIN_SOURCE_DIR) + "/configs/" + name);
    EXPECT_GT(c.model.n_experts, 1) << name;
  }
}

TEST(Trainer, FreshRunNeverOverwritesAnotherRunsCheckpoints) {
  TempDir tmp("reuse");
  RunConfig cfg = small_run(tmp);
  {
    Trainer t(cfg, false);
    t.run(2);
  }
  try {
    Trainer t(cfg, false);
    FAIL() << "a fresh run was allowed into a directory with checkpoints";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--resume"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::exists(checkpoint_dir(cfg.train.run_dir, 2)));
  Trainer resumed(cfg, true);
  EXPECT_EQ(resumed.step(), 2);
}

TEST(Trainer, NonFiniteLossStopsTheRunAndKeepsTheLastGoodCheckpoint) {
  TempDir tmp("nan");
  RunConfig cfg = small_run(tmp);
  cfg.train.checkpoint_every = 2;
  Trainer t(cfg, false);
  t.run(2);
  ASSERT_TRUE(fs::exists(checkpoint_dir(cfg.train.run_dir, 2)));
  // A NaN in the embedding table poisons the forward of the next step.
  for (int i = 0; i < 32 * 256; ++i) t.params()[t.model().layout().embed + i] = std::nanf("");
  try {
    t.run();
    FAIL() << "a NaN loss did not stop the run";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step 3"), std::string::npos) << e.what();
  }
  auto latest = find_latest_checkpoint(cfg.train.run_dir);
  ASSERT_TRUE(latest);
  EXPECT_EQ(latest->filename(), "step_00000002");
  LoadedModel m = load_model(cfg.train.run_dir);
  for (float v : m.params) ASSERT_TRUE(std::isfinite(v));
}

TEST(Trainer, AWrongTypeInTrainerStateNamesTheFile) {
  TempDir tmp("badstate");
  RunConfig cfg = small_run(tmp);
  cfg.train.checkpoint_every = 2;
  {
    Trainer t(cfg, false);
    t.run(2);
  }
  const fs::path dir = checkpoint_dir(cfg.train.run_dir, 2);
  // A well-formed file with a key of the wrong type, which the manifest vouches for.
  nlohmann::json state = read_checkpoint_json(dir, "trainer_state.json");
  state["step"] = "two";
  resign_checkpoint_file(dir, "trainer_state.json", state.dump(2));
  try {
    Trainer resumed(cfg, true);
    FAIL() << "resumed from a trainer_state.json whose step is a string";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir / "trainer_state.json").string()), std::string::npos)
        << e.what();
  }
}

// A re-signed trainer_state.json claiming step 999: the resume refuses that checkpoint (naming the
// file), continues from the previous one, and never writes a step the run did not reach.
TEST(Trainer, AResignedStepFallsBackAndIsNeverWritten) {
  TempDir tmp("resigned_step");
  RunConfig cfg = small_run(tmp);
  cfg.train.checkpoint_every = 2;
  cfg.train.keep_checkpoints = 3;
  {
    Trainer t(cfg, false);
    t.run(4);
  }
  const fs::path dir = checkpoint_dir(cfg.train.run_dir, 4);
  nlohmann::json state = read_checkpoint_json(dir, "trainer_state.json");
  state["step"] = 999;
  resign_checkpoint_file(dir, "trainer_state.json", state.dump(2));
  ::testing::internal::CaptureStderr();
  {
    Trainer resumed(cfg, true);
    EXPECT_EQ(resumed.step(), 2);
    resumed.run(6);
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find((dir / "trainer_state.json").string()), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(checkpoint_dir(cfg.train.run_dir, 999)));
  EXPECT_TRUE(fs::exists(checkpoint_dir(cfg.train.run_dir, 6)));
  EXPECT_EQ(read_checkpoint_json(dir, "trainer_state.json")["step"], 4);  // rewritten at step 4
}

TEST(Trainer, CheckpointWithoutSeqLenSamplesWithinMaxSeqLen) {
  TempDir tmp("noseqlen");
  RunConfig cfg = small_run(tmp);
  cfg.train.seq_len = 16;
  {
    Trainer t(cfg, false);
    t.run(1);
  }
  // A checkpoint from before the trained context was relied on: no train.seq_len recorded.
  const fs::path dir = *find_latest_checkpoint(cfg.train.run_dir);
  nlohmann::json config = read_checkpoint_json(dir, "config.json");
  ASSERT_TRUE(config["moetrain"]["train"].contains("seq_len"));
  config["moetrain"]["train"].erase("seq_len");
  resign_checkpoint_file(dir, "config.json", config.dump(2));
  EXPECT_EQ(load_model(dir).trained_context, cfg.model.max_seq_len);
}
