// Tensor parallelism (dist.tp = 2: each model copy run by two processes on one batch) against the
// one-process run with the same global batch and seed: alone (np 2: one copy; np 4: two copies,
// data-parallel), with the experts sharded over the tensor-parallel ranks (dist.ep = 2: the MoE
// layers' tokens and experts split over the same ranks, Megatron-Core's folding with expert
// tensor parallelism 1), and under ZeRO-1 and recompute = full.
//
// Not bitwise: the attention's output projection, a dense FFN's down projection and the LM head's
// input gradient are sums over the ranks' heads, hidden units and vocabulary columns (GEMMs of
// K/2 added, instead of one GEMM over K), and the cross-entropy's exponentials are summed per
// vocabulary half. Each is a reordering of a float sum of ≤ 32 terms (relative error ≤ K·ε =
// 4e-6 a product); over 20 AdamW steps (clipped at 0.5, whose updates are ~lr whatever the
// gradient's last bits) the data-parallel tests' bounds hold: losses 1e-5, norms 1e-4, parameters
// 1e-4 of the largest.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "parallel/runtime.h"
#include "parallel/tensor_parallel_runs.h"  // tests/parallel/tensor_parallel_runs.h
#include "support/corpus.h"
#include "support/held_values.h"
#include "support/run_metrics.h"
#include "support/shared_dir.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

// The one-process run of the whole global batch (a batch of every copy's rows), on every rank.
TpFigures run_single(const fs::path& data, int copies, std::vector<std::string> extra) {
  TempDir run("tp_single");
  extra.insert(extra.end(), {"dist.ep=1", "dist.zero=0", "dist.sequence_parallel=false"});
  Trainer t(tp_config(data, run.path(), kTpRows * copies, 1, extra), false, make_local_comm());
  t.run();
  return tp_figures(t, run.path());
}

TpFigures run_tp(const fs::path& data, const fs::path& run, const std::vector<std::string>& extra,
                 int64_t stop_at = -1, bool resume = false) {
  Trainer t(tp_config(data, run, kTpRows, kTp, extra), resume, dist_world("tp_test"));
  t.run(stop_at);
  return tp_figures(t, run);
}

void expect_follows_single(const std::string& name, const std::vector<std::string>& extra) {
  auto world = dist_world("tp");
  const int W = world->size(), r = world->rank();
  SharedDir dir(*world, ("tp_" + name).c_str());
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const TpFigures ref = run_single(dir / "data", W / kTp, extra);
  const TpFigures got = run_tp(dir / "data", dir / "run", extra);
  expect_tp_follows(name, r, got, ref);
  expect_checkpoint_holds(dir / "run", got);
}

}  // namespace

TEST(TensorParallel, FollowsTheOneProcessRun) { expect_follows_single("alone", {}); }

TEST(TensorParallel, WithExpertsShardedOverTheTensorParallelRanks) {
  expect_follows_single("ep", {"dist.ep=2", "model.router=sigmoid_bias",
                               "model.bias_update_rate=0.01"});
}

// Sequence parallelism: each rank's stream, norms and MoE layers on its half of the tokens, the
// attention's and dense FFN's inputs gathered and outputs reduce-scattered; also with the
// experts sharded and the blocks recomputed.
TEST(TensorParallel, WithSequenceParallelism) {
  expect_follows_single("sp", {"dist.sequence_parallel=true"});
  expect_follows_single("sp_ep_full",
                        {"dist.sequence_parallel=true", "dist.ep=2", "train.recompute=full"});
}

TEST(TensorParallel, UnderZeroOneAndFullRecomputation) {
  expect_follows_single("zero_recompute", {"dist.zero=1", "train.recompute=full"});
}

// Stopped at step 10 and resumed from its checkpoint: the uninterrupted run's bits. And the
// checkpoint of the tensor-parallel run resumed by one process (the same global batch as
// micro-batches), which starts from the run's parameters, bit for bit.
TEST(TensorParallel, ResumesBitExactAndItsCheckpointLoadsOnOneProcess) {
  auto world = dist_world("tp_resume");
  const int r = world->rank();
  SharedDir dir(*world, "tp_resume");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const TpFigures whole = run_tp(dir / "data", dir / "whole", {});
  run_tp(dir / "data", dir / "split", {}, 10);
  const TpFigures resumed = run_tp(dir / "data", dir / "split", {}, -1, true);
  EXPECT_EQ(0, std::memcmp(resumed.params.data(), whole.params.data(),
                           whole.params.size() * sizeof(float)))
      << "the resumed tensor-parallel run differs from the uninterrupted one";
  // One process loads the step-10 checkpoint: the parameters it starts from are the run's.
  expect_one_process_resumes_step10(dir / "data", dir / "whole", world->size() / kTp);
}
