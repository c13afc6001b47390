// Elastic resume with real processes: a checkpoint written by `mpiexec -n 4 moetrain train`
// (2 data-parallel x 2 expert-parallel, ZeRO-1) resumed by 1, 2, 3 and 8 processes on other
// layouts. Each resumed run re-shards what it loads and writes the checkpoint again with its own
// layout; every parameter, optimizer moment and router bias must come back bitwise. Training then
// continues with the same global batch, and a process count that cannot keep it is refused.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "support/checkpoint_tensors.h"
#include "support/corpus.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kSavedAt = 3;
constexpr int64_t kGlobalBatch = 24;  // sequences per step: 4 processes x 1 x 6 micro-batches

struct Result {
  int code;
  std::string output;  // stdout and stderr together
};

Result shell(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed: " + cmd};
  std::string out;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

bool have_mpiexec() {
  return shell("command -v mpiexec").code == 0;
}

// `moetrain train` on the test's model, with `extra` flags.
std::string train_args(const fs::path& data, const fs::path& run, int64_t steps,
                       const std::string& extra) {
  std::string cmd = std::string(MOETRAIN_BINARY) + " train --config " + MOETRAIN_SOURCE_DIR +
                    "/configs/tiny.toml";
  const std::vector<std::string> sets = {"model.dim=32",
                                         "model.n_layers=2",
                                         "model.n_heads=4",
                                         "model.n_kv_heads=2",
                                         "model.expert_hidden=24",
                                         "model.n_experts=8",
                                         "model.top_k=2",
                                         "model.router=sigmoid_bias",
                                         "model.bias_update_rate=0.01",
                                         "model.max_seq_len=16",
                                         "train.batch_size=1",
                                         "train.seq_len=16",
                                         "train.grad_accum=6",
                                         "train.eval_every=0",
                                         "train.eval_batches=1",
                                         "train.checkpoint_every=0",
                                         "train.progress=off",
                                         "optim.warmup_steps=1",
                                         "data.dir=" + data.string(),
                                         "train.run_dir=" + run.string(),
                                         "train.steps=" + std::to_string(steps)};
  for (const std::string& s : sets) cmd += " --set " + s;
  return cmd + " " + extra;
}

constexpr const char* kMpiexec = "mpiexec --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1";

// `mpiexec -n np moetrain train ...`.
Result train(int np, const fs::path& data, const fs::path& run, int64_t steps,
             const std::string& extra) {
  return shell(std::string(kMpiexec) + " -n " + std::to_string(np) + " " +
               train_args(data, run, steps, extra));
}

std::vector<double> losses(const fs::path& run_dir) {
  std::vector<double> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

class ElasticResume : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!have_mpiexec()) return;
    tmp_ = std::make_unique<TempDir>("elastic");
    write_corpus(*tmp_ / "data", 40000);
    Result r = train(4, *tmp_ / "data", *tmp_ / "saved", kSavedAt, "--ep 2 --zero 1");
    saved_ok_ = r.code == 0;
    if (!saved_ok_) saved_output_ = r.output;
  }
  static void TearDownTestSuite() { tmp_.reset(); }

  void SetUp() override {
    if (!have_mpiexec()) GTEST_SKIP() << "no mpiexec on PATH: multi-process resume not testable";
    ASSERT_TRUE(saved_ok_) << "the 4-process run failed:\n" << saved_output_;
  }

  // A copy of the saved run, for one resumed run to continue.
  static fs::path copy_of_saved(const std::string& name) {
    fs::path dst = *tmp_ / name;
    fs::copy(*tmp_ / "saved", dst, fs::copy_options::recursive);
    return dst;
  }

  static std::unique_ptr<TempDir> tmp_;
  static bool saved_ok_;
  static std::string saved_output_;
};

std::unique_ptr<TempDir> ElasticResume::tmp_;
bool ElasticResume::saved_ok_ = false;
std::string ElasticResume::saved_output_;

}  // namespace

TEST_F(ElasticResume, FourProcessCheckpointReloadsBitwiseOnOneTwoThreeAndEight) {
  const fs::path saved = checkpoint_dir(*tmp_ / "saved", kSavedAt);
  const auto want = read_all_tensors(saved);
  EXPECT_EQ(read_checkpoint_json(saved, "manifest.json")["world_size"], 4);
  EXPECT_TRUE(fs::exists(saved / "model.safetensors.index.json"));
  EXPECT_EQ(read_checkpoint_json(saved, "trainer_state.json")["data"]["global_batch"],
            kGlobalBatch);
  std::size_t optimizer_tensors = 0, state_tensors = 0;
  for (const auto& [name, v] : want) {
    optimizer_tensors += name.starts_with("optimizer/");
    state_tensors += name.starts_with("state/");
  }
  EXPECT_GT(optimizer_tensors, 0u);
  EXPECT_EQ(state_tensors, 2u);  // a router bias per MoE layer

  struct Layout {
    int np;
    const char* flags;
  };
  int index = 0;
  for (const Layout& l : {Layout{1, ""}, Layout{2, "--ep 2"}, Layout{3, "--zero 1"},
                          Layout{8, "--ep 4"}, Layout{8, "--ep 2 --zero 1"}}) {
    SCOPED_TRACE(::testing::Message() << "np " << l.np << " " << l.flags);
    fs::path run = copy_of_saved("layout" + std::to_string(index++));
    // No step to take: the resumed run loads the checkpoint (re-sharding it) and saves it again
    // at the same step with its own layout.
    Result r = train(l.np, *tmp_ / "data", run, kSavedAt, std::string("--resume ") + l.flags);
    ASSERT_EQ(r.code, 0) << r.output;
    const fs::path again = checkpoint_dir(run, kSavedAt);
    nlohmann::json manifest = read_checkpoint_json(again, "manifest.json");
    EXPECT_EQ(manifest["world_size"], l.np);
    EXPECT_EQ(fs::exists(again / "model.safetensors.index.json"), l.np > 1);
    nlohmann::json state = read_checkpoint_json(again, "trainer_state.json");
    EXPECT_EQ(state["step"], kSavedAt);
    EXPECT_EQ(state["optimizer"]["step_count"], kSavedAt);
    EXPECT_EQ(state["data"]["global_batch"], kGlobalBatch);
    EXPECT_EQ(state["layout"]["grad_accum"], kGlobalBatch / l.np);
    const auto got = read_all_tensors(again);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [tensor, values] : want) {
      auto it = got.find(tensor);
      ASSERT_NE(it, got.end()) << tensor;
      ASSERT_EQ(it->second.size(), values.size()) << tensor;
      EXPECT_EQ(0, std::memcmp(it->second.data(), values.data(), values.size() * sizeof(float)))
          << tensor << " differs after a round trip through " << l.np << " processes";
    }
  }
}

TEST_F(ElasticResume, TrainingContinuesWithTheSameGlobalBatch) {
  // Two more steps on the original 4 processes, and on 2 with twice the accumulation: the same
  // windows per step, summed in another order.
  fs::path four = copy_of_saved("continue4"), two = copy_of_saved("continue2");
  Result a = train(4, *tmp_ / "data", four, kSavedAt + 2, "--resume --ep 2 --zero 1");
  ASSERT_EQ(a.code, 0) << a.output;
  Result b = train(2, *tmp_ / "data", two, kSavedAt + 2, "--resume --ep 2");
  ASSERT_EQ(b.code, 0) << b.output;
  EXPECT_NE(b.output.find("train.grad_accum = 12 instead of 6"), std::string::npos) << b.output;
  auto la = losses(four), lb = losses(two);
  ASSERT_EQ(la.size(), static_cast<std::size_t>(kSavedAt + 2));
  ASSERT_EQ(lb.size(), la.size());
  for (std::size_t i = 0; i < la.size(); ++i) {
    if (i < kSavedAt) {
      EXPECT_EQ(la[i], lb[i]) << "step " << i + 1 << " (before the resume)";
    }
    EXPECT_LE(std::abs(la[i] - lb[i]), 1e-5 * std::abs(la[i])) << "step " << i + 1;
  }
}

TEST_F(ElasticResume, AProcessCountThatCannotKeepTheGlobalBatchIsRefused) {
  fs::path run = copy_of_saved("np5");
  Result r = train(5, *tmp_ / "data", run, kSavedAt + 1, "--resume");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("global batch of 24 sequences"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("5 processes"), std::string::npos) << r.output;
  // Nothing was written: the checkpoint is the 4-process one.
  EXPECT_EQ(read_checkpoint_json(checkpoint_dir(run, kSavedAt), "manifest.json")["world_size"], 4);
}

TEST_F(ElasticResume, RanksStartedWithDifferentConfigurationsFailAtOnce) {
  // One launch, two programs (MPMD): the second rank's learning rate differs.
  const fs::path run = *tmp_ / "mismatch";
  Result r = shell(std::string(kMpiexec) + " -n 1 " + train_args(*tmp_ / "data", run, 2, "") +
                   " : -n 1 " + train_args(*tmp_ / "data", run, 2, "--set optim.lr=0.01"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("rank 1 has optim.lr = 0.01, rank 0 has optim.lr = 0.003"),
            std::string::npos)
      << r.output;
  // Refused before anything was created: no lock file, metrics or event files left behind.
  EXPECT_FALSE(fs::exists(run)) << r.output;
}
