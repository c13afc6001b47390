// Activation recomputation under expert parallelism (dist.ep = 2): training with train.recompute =
// moe and full gives the losses and final parameters of the same layout without recompute, bit
// for bit — full exchanging the rows again in the backward, every rank recomputing the same
// blocks in the same order — with shared experts, capacity dropping, chunked all-to-alls over the
// communication thread, f32 and bf16.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "parallel/runtime.h"
#include "support/corpus.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

struct Outcome {
  std::vector<double> losses;  // metrics.jsonl "loss", per step (rank 0)
  std::vector<float> params;
};

class DistRecompute : public ::testing::Test {
 protected:
  void SetUp() override {
    world_ = dist_world("recompute");
    if (world_->rank() == 0) {
      own_ = std::make_unique<TempDir>("dist_recompute");
      dir_ = own_->path().string();
      write_corpus(own_->path() / "data", 30000);
    }
    int64_t len = static_cast<int64_t>(dir_.size());
    world_->broadcast(&len, sizeof(len));
    dir_.resize(static_cast<std::size_t>(len));
    world_->broadcast(dir_.data(), len);
  }

  Outcome train(const std::string& run, const std::vector<std::string>& extra) {
    std::vector<std::string> o = {"model.dim=32",
                                  "model.n_layers=3",
                                  "model.n_heads=4",
                                  "model.n_kv_heads=2",
                                  "model.expert_hidden=24",
                                  "model.n_experts=4",
                                  "model.top_k=2",
                                  "model.dense_every=3",
                                  "model.shared_expert_hidden=16",
                                  "model.capacity_factor=1.0",
                                  "model.max_seq_len=16",
                                  "train.batch_size=2",
                                  "train.seq_len=16",
                                  "train.steps=5",
                                  "train.eval_every=0",
                                  "train.eval_batches=1",
                                  "train.progress=off",
                                  "train.tensorboard=false",
                                  "optim.warmup_steps=2",
                                  "data.dir=" + dir_ + "/data",
                                  "train.run_dir=" + dir_ + "/" + run,
                                  "dist.ep=2"};
    o.insert(o.end(), extra.begin(), extra.end());
    Trainer t(load_run_config("", o), false, dist_world("t_" + run));
    t.run();
    Outcome out;
    out.params = t.params();
    if (world_->rank() == 0) {
      std::ifstream in(fs::path(dir_) / run / "metrics.jsonl");
      for (std::string l; std::getline(in, l);) {
        const auto j = nlohmann::json::parse(l);
        if (j.contains("loss")) out.losses.push_back(j["loss"].get<double>());
      }
    }
    return out;
  }

  void expect_same(const std::vector<std::string>& extra, const std::string& tag) {
    const Outcome none = train(tag + "_none", extra);
    for (const char* mode : {"moe", "full"}) {
      SCOPED_TRACE(tag + ": recompute = " + mode);
      std::vector<std::string> e = extra;
      e.push_back(std::string("train.recompute=") + mode);
      const Outcome got = train(tag + "_" + mode, e);
      ASSERT_EQ(got.params.size(), none.params.size());
      EXPECT_EQ(std::memcmp(got.params.data(), none.params.data(), none.params.size() * 4), 0)
          << "rank " << world_->rank();
      if (world_->rank() == 0) {
        ASSERT_EQ(none.losses.size(), 5u);
        EXPECT_EQ(got.losses, none.losses);
      }
    }
    world_->barrier();
  }

  std::unique_ptr<Comm> world_;
  std::unique_ptr<TempDir> own_;
  std::string dir_;
};

TEST_F(DistRecompute, F32ChunkedExchangeSameBits) {
  expect_same({"train.precision=f32", "dist.a2a_chunks=2", "dist.overlap=true"}, "f32");
}

TEST_F(DistRecompute, Bf16NoisyRouterSameBits) {
  expect_same({"train.precision=bf16", "model.router=noisy_topk", "dist.a2a_dtype=bf16"}, "bf16");
}

}  // namespace
