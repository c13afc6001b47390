// dist.offload = host_file in the trainer: the run is bitwise the in-memory one (AdamW and
// RMSProp, bf16 weights, sparse experts); a run interrupted and resumed with offload is bitwise the
// straight one, and so is one resumed across the switch either way (checkpoints hold the state,
// not the file); the state files go when the run ends; the keys refuse what they cannot do.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/corpus.h"
#include "support/expect_error.h"
#include "support/run_metrics.h"
#include "support/small_run.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

// 8 experts, top-1 (some experts untouched each step, so sparse_experts freezes ranges), bf16.
// One corpus for every run of this file (its tokenizer is trained once).
const fs::path& shared_data() {
  static TempDir dir("offload_data");
  static const bool written = (write_corpus(dir / "data", 40000), true);
  (void)written;
  static const fs::path path = dir / "data";
  return path;
}

RunConfig offload_run(const TempDir& tmp, bool offload, std::vector<std::string> extra = {}) {
  std::vector<std::string> keys = small_run_keys(tmp);
  keys.push_back("data.dir=" + shared_data().string());
  for (const char* k : {"model.n_experts=8", "model.top_k=1", "train.precision=bf16",
                        "grad.sparse_experts=true", "train.steps=4"})
    keys.push_back(k);
  keys.push_back(std::string("dist.offload=") + (offload ? "host_file" : "none"));
  keys.insert(keys.end(), extra.begin(), extra.end());
  return load_run_config("", keys);
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

bool dir_empty(const fs::path& d) { return fs::is_directory(d) && fs::is_empty(d); }

}  // namespace

TEST(OffloadTrain, RunIsBitwiseTheInMemoryOne) {
  for (const char* optim : {"optim.name=adamw", "optim.name=rmsprop"}) {
    std::vector<float> params[2];
    std::vector<double> losses[2];
    for (bool on : {false, true}) {
      TempDir tmp(on ? "offload_on" : "offload_off");
      {
        Trainer t(offload_run(tmp, on, {optim}), false);
        if (on) {
          // The state lives in the file; a step keeps only the ring of chunks in memory.
          ASSERT_NE(t.optimizer().offload_store(), nullptr);
          EXPECT_TRUE(fs::exists(tmp / "run/offload/optim-rank0.bin"));
        }
        t.run();
        params[on] = t.params();
      }
      losses[on] = metric(tmp / "run", "loss");
      if (on) {
        EXPECT_TRUE(dir_empty(tmp / "run/offload")) << "state file left after the run";
      }
    }
    EXPECT_TRUE(same_bits(params[0], params[1])) << optim;
    EXPECT_EQ(losses[0], losses[1]) << optim;
  }
}

// Interrupted after 2 of 4 steps with offload `first`, resumed with offload `second`: the bits of
// 4 straight offloaded steps.
void expect_resume_bitwise(bool first, bool second) {
  std::vector<float> straight;
  {
    TempDir tmp("offload_straight");
    Trainer t(offload_run(tmp, true), false);
    t.run();
    straight = t.params();
  }
  TempDir tmp("offload_resume");
  {
    Trainer t(offload_run(tmp, first), false);
    t.run(2);
  }
  Trainer t(offload_run(tmp, second), true);
  EXPECT_EQ(t.step(), 2);
  t.run();
  EXPECT_TRUE(same_bits(t.params(), straight))
      << "offload " << first << " then " << second << ": resumed run differs";
}

TEST(OffloadTrain, ResumesBitExactly) { expect_resume_bitwise(true, true); }
TEST(OffloadTrain, CheckpointOfAnOffloadedRunResumesInMemory) { expect_resume_bitwise(true, false); }
TEST(OffloadTrain, CheckpointOfAnInMemoryRunResumesOffloaded) { expect_resume_bitwise(false, true); }

TEST(OffloadTrain, KeysRefuseWhatTheyCannotDo) {
  TempDir tmp("offload_keys");
  expect_error([&] { offload_run(tmp, false, {"dist.offload=ssd"}); },
               "dist.offload = 'ssd': allowed are none, host_file");
  // A directory that cannot be created (a file is in the way), one that cannot be written.
  { std::ofstream(tmp / "file") << "x"; }
  const std::string blocked = (tmp / "file" / "offload").string();
  expect_error([&] { offload_run(tmp, true, {"dist.offload_dir=" + blocked}); },
               std::vector<std::string>{"dist.offload_dir = '" + blocked +
                                        "': cannot create the directory"});
  expect_error([&] { offload_run(tmp, true, {"dist.offload_dir=/proc"}); },
               "dist.offload_dir = '/proc': cannot write a file there");
  EXPECT_FALSE(fs::exists(tmp / "run")) << "a refused configuration wrote the run directory";
  expect_error([&] { offload_run(tmp, true, {"train.device=cuda", "grad.sparse_experts=false"}); },
               "dist.offload = host_file with train.device = cuda");
}
