// Dynamic capacity under expert parallelism: every rank uses the same capacity and the same
// controller factor at every step, although each routes its own tokens.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/comm.h"
#include "parallel/runtime.h"
#include "support/corpus.h"
#include "support/shared_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kSteps = 6;

RunConfig dynamic_config(const fs::path& data, const fs::path& run, int ep) {
  return load_run_config(
      "",
      {"model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
       "model.expert_hidden=24", "model.n_experts=4", "model.top_k=2", "model.max_seq_len=16",
       // Capped mode at 2: the bound (2·N·K/E) is above what any expert needs, so without
       // agreement each rank's capacity would be its own largest load.
       "model.capacity=dynamic", "model.capacity_factor=-2", "balance.window=3",
       "balance.util_low=0.97", "balance.util_high=0.99", "balance.imbalance_high=1.0",
       "balance.imbalance_low=1.0", "train.batch_size=2", "train.seq_len=16",
       "train.steps=" + std::to_string(kSteps), "train.eval_every=0", "train.checkpoint_every=0",
       "train.progress=off", "optim.warmup_steps=2", "data.dir=" + data.string(),
       "train.run_dir=" + run.string(), "dist.ep=" + std::to_string(ep)});
}

}  // namespace

TEST(DistCapacity, ExpertParallelRanksAgreeOnCapacityEveryStep) {
  auto world = dist_world("capacity");
  SharedDir dir(*world, "dist_capacity");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  Trainer t(dynamic_config(dir / "data", dir / "run", world->size()), false,
            dist_world("capacity_train"));
  std::vector<double> factors;
  for (int64_t s = 1; s <= kSteps; ++s) {
    t.run(s);
    for (MoeLayer* layer : t.model().moe_layers()) {
      const MoeStats& st = layer->stats();
      const std::vector<int64_t> caps = world->allgather_one(st.capacity);
      const std::vector<int64_t> cfs =
          world->allgather_one(static_cast<int64_t>(layer->capacity_factor() * 1e6f));
      for (int q = 1; q < world->size(); ++q) {
        EXPECT_EQ(caps[q], caps[0]) << "step " << s << " rank " << q;
        EXPECT_EQ(cfs[q], cfs[0]) << "step " << s << " rank " << q;
      }
      EXPECT_GT(st.capacity, 0);
      EXPECT_EQ(st.capacity,
                std::min(st.needed, expert_capacity(2 * 16, 2, 4, -st.capacity_factor)));
      factors.push_back(layer->capacity_factor());
    }
  }
  EXPECT_NE(factors.front(), factors.back()) << "the controller never moved the factor";
}
