// Expert tensor parallelism (dist.etp = 2: each expert's hidden units split over two neighbouring
// ranks, which all-gather the rows their exchanges brought, each compute their half of every
// expert's hidden units and reduce-scatter the partial outputs) against the one-process run with
// the same global batch and seed: alone (np 2: the ETP group is the world, each rank a
// data-parallel copy; np 4: two ETP groups), with the experts sharded over EP groups of the ranks
// of one ETP position (np 4: dist.ep = 2), and under tensor parallelism (dist.tp = 2: the ETP
// groups are the tensor-parallel groups).
//
// Not bitwise: an expert's output and its input gradient are sums of two partial GEMMs over
// F/2 = 12 hidden units each, added by the reduce-scatter, instead of one GEMM over F = 24; a
// reordering of a float sum of ≤ 32 terms, as tensor parallelism's shares are
// (tensor_parallel_test.cpp argues the bounds: losses 1e-5, norms 1e-4, parameters 1e-4 of the
// largest over 20 clipped AdamW steps).
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "parallel/runtime.h"
#include "parallel/tensor_parallel_runs.h"  // tests/parallel/tensor_parallel_runs.h
#include "support/corpus.h"
#include "support/held_values.h"
#include "support/shared_dir.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

// The one-process run of the whole global batch (every copy's rows), on every rank.
TpFigures run_single(const fs::path& data, int64_t rows, const std::vector<std::string>& extra) {
  TempDir run("etp_single");
  Trainer t(tp_config(data, run.path(), rows, 1, extra), false, make_local_comm());
  t.run();
  return tp_figures(t, run.path());
}

TpFigures run_etp(const fs::path& data, const fs::path& run, int64_t tp,
                  std::vector<std::string> extra, int64_t stop_at = -1, bool resume = false) {
  extra.push_back("dist.etp=2");
  Trainer t(tp_config(data, run, kTpRows, tp, extra), resume, dist_world("etp_test"));
  t.run(stop_at);
  return tp_figures(t, run);
}

// dist.etp = 2 (with dist.tp = tp and `extra`) against one process, and its checkpoint.
void expect_follows_single(const std::string& name, int64_t tp, std::vector<std::string> extra) {
  auto world = dist_world("etp");
  const int W = world->size(), r = world->rank();
  SharedDir dir(*world, ("etp_" + name).c_str());
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const TpFigures got = run_etp(dir / "data", dir / "run", tp, extra);
  std::vector<std::string> single = extra;
  single.push_back("dist.ep=1");
  const TpFigures ref = run_single(dir / "data", kTpRows * (W / tp), single);
  expect_tp_follows(name, r, got, ref);
  expect_checkpoint_holds(dir / "run", got);
}

}  // namespace

TEST(ExpertTensorParallel, FollowsTheOneProcessRun) { expect_follows_single("alone", 1, {}); }

TEST(ExpertTensorParallel, WithExpertParallelGroupsOverOneEtpPosition) {
  if (dist_world("etp_ep")->size() % 4 != 0) GTEST_SKIP() << "dist.ep = 2 × dist.etp = 2: np 4";
  expect_follows_single("ep", 1, {"dist.ep=2", "model.router=sigmoid_bias",
                                  "model.bias_update_rate=0.01"});
}

TEST(ExpertTensorParallel, UnderTensorParallelism) { expect_follows_single("tp", 2, {}); }

// Stopped at step 10 and resumed from its checkpoint: the uninterrupted run's bits. And its
// step-10 checkpoint resumed by one process (the same global batch as micro-batches), which
// starts from the run's parameters, bit for bit.
TEST(ExpertTensorParallel, ResumesBitExactAndItsCheckpointLoadsOnOneProcess) {
  auto world = dist_world("etp_resume");
  const int r = world->rank(), W = world->size();
  SharedDir dir(*world, "etp_resume");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const TpFigures whole = run_etp(dir / "data", dir / "whole", 1, {});
  run_etp(dir / "data", dir / "split", 1, {}, 10);
  const TpFigures resumed = run_etp(dir / "data", dir / "split", 1, {}, -1, true);
  EXPECT_EQ(0, std::memcmp(resumed.params.data(), whole.params.data(),
                           whole.params.size() * sizeof(float)))
      << "the resumed expert tensor-parallel run differs from the uninterrupted one";
  // One process loads the step-10 checkpoint: the parameters it starts from are the run's.
  expect_one_process_resumes_step10(dir / "data", dir / "whole", W);
}
