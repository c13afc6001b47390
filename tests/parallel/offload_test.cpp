// dist.offload = host_file under ZeRO-1 (MPI, np 2 and 4): each process streams its shard's state
// through its own file, and the run is bitwise the in-memory ZeRO-1 one; interrupted and resumed
// with offload, it is bitwise the straight run.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "parallel/runtime.h"
#include "support/corpus.h"
#include "support/run_metrics.h"
#include "support/shared_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

RunConfig zero_config(const fs::path& dir, const std::string& run, bool offload) {
  return load_run_config(
      "", {"model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
           "model.expert_hidden=24", "model.n_experts=4", "model.top_k=2",
           "model.max_seq_len=16", "train.batch_size=2", "train.seq_len=16", "train.steps=8",
           "train.eval_every=0", "train.checkpoint_every=0", "train.progress=off",
           "optim.warmup_steps=2", "optim.grad_clip=0.5", "data.dir=" + (dir / "data").string(),
           "train.run_dir=" + (dir / run).string(), "dist.zero=1", "dist.bucket_first_mb=0.01",
           "dist.bucket_mb=0.05", std::string("dist.offload=") + (offload ? "host_file" : "none")});
}

std::vector<float> run(const fs::path& dir, const std::string& name, bool offload,
                       int64_t stop_at = -1, bool resume = false) {
  Trainer t(zero_config(dir, name, offload), resume, dist_world("offload_run"));
  if (offload) {
    EXPECT_NE(t.optimizer().offload_store(), nullptr);
    EXPECT_TRUE(fs::exists(dir / name / "offload" / fmt::format("optim-rank{}.bin", t.rank())));
  }
  t.run(stop_at);
  return t.params();
}

}  // namespace

TEST(DistOffload, ZeroOneWithOffloadIsBitwiseWithoutAndResumes) {
  auto world = dist_world("offload");
  SharedDir dir(*world, "dist_offload");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const std::vector<float> mem = run(dir.path(), "mem", false);
  const std::vector<float> off = run(dir.path(), "off", true);
  ASSERT_EQ(mem.size(), off.size());
  EXPECT_EQ(std::memcmp(mem.data(), off.data(), mem.size() * sizeof(float)), 0)
      << "ZeRO-1 with offload differs from ZeRO-1 in memory";
  world->barrier();
  EXPECT_TRUE(fs::is_empty(dir / "off/offload")) << "state files left after the run";
  if (world->rank() == 0) {
    EXPECT_EQ(metric(dir / "mem", "loss"), metric(dir / "off", "loss"));
  }
  run(dir.path(), "resumed", true, 4);
  const std::vector<float> resumed = run(dir.path(), "resumed", true, -1, true);
  EXPECT_EQ(std::memcmp(resumed.data(), off.data(), off.size() * sizeof(float)), 0)
      << "resumed run with offload differs from the straight one";
}
