// ZeRO-3 (dist.zero = 3) inside pipeline stages: each stage's parameters sharded over the stage's
// copies (its data-parallel ranks; under dist.tp every tensor-parallel rank of it), every
// activation slot's model gathering each unit of its chunk where its forward and backward use it
// (train/pipeline_step.h). On 2 processes (one pipeline of 2 stages) a stage has one copy: there
// is nothing to shard over, and ZeRO-3 keeps the stage's parameters whole, as ZeRO-1 and 2 do; on
// 4 (two pipelines) each stage's copies hold half of it each.
//
// Bitwise against ZeRO-2 in the same stages: both reduce-scatter the stage's accumulated
// gradients once a step over the same copies (Zero2Reducer, GradSync), and Comm::reduce_scatter
// adds each element's contributions in rank order whatever bucket holds it (ZeRO-3 cuts its
// buckets at the gather units, ZeRO-2 does not; here each element is a sum of two terms besides,
// which rounds alike in either order); both step the shard with the same elementwise AdamW (the
// clip is off: the gradient norm sums the shards' squares in another grouping, 1e-12 relative),
// and the values a gather brings are the bits their owner stepped, which ZeRO-2's all-gather
// brings too. So every forward and backward reads the same weights,
// and the parameters, the losses, the validation losses and the checkpoint are ZeRO-2's bits.
// Against the one-process run: bitwise with one pipeline (tests/parallel/pipeline_test.cpp and
// pipeline_interleaved_test.cpp argue it), within the data-parallel bounds with two
// (pipeline_test.cpp's TwoPipelinesOfTwoStages: losses 1e-5, norms 1e-4, parameters 1e-4 of the
// largest), and under dist.tp = 2 within pipeline_tp_test.cpp's bounds (the same).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/page_buffer.h"
#include "parallel/pipeline_runs.h"  // tests/parallel/pipeline_runs.h
#include "parallel/runtime.h"
#include "support/checkpoint_tensors.h"
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

// Pages of the flat parameter buffer that a release hands back whole (inside the buffer, one
// gather unit's values only, none of them in this rank's shard), after a run: every value on them
// must read 0. stage_pages counts those of this rank's stage, whose units its passes gathered and
// released.
struct Released {
  int64_t pages = 0, stage_pages = 0, stale = 0;  // stale: values on them that do not read 0
};

Released released_pages(Trainer& t, const std::vector<char>& stage) {
  const FlatParams params = t.params();
  const auto n = static_cast<int64_t>(params.size());
  std::vector<char> shard(static_cast<std::size_t>(n), 0);
  for (const OptimPiece& p : t.optimizer().pieces())
    std::fill_n(shard.begin() + p.offset, p.size, 1);
  std::vector<int64_t> unit(static_cast<std::size_t>(n), 0);
  const std::vector<int64_t> starts = t.model().unit_starts();
  for (std::size_t u = 0; u < starts.size(); ++u)
    std::fill(unit.begin() + starts[u], unit.end(), static_cast<int64_t>(u));
  // The buffer is page-aligned (core/page_buffer.h).
  const auto per = static_cast<int64_t>(PageBuffer::page_bytes() / sizeof(float));
  Released out;
  for (int64_t lo = 0; lo + per <= n; lo += per) {
    bool whole = true;
    for (int64_t i = lo; i < lo + per && whole; ++i)
      whole = !shard[static_cast<std::size_t>(i)] && unit[static_cast<std::size_t>(i)] ==
                                                         unit[static_cast<std::size_t>(lo)];
    if (!whole) continue;
    ++out.pages;
    out.stage_pages += stage[static_cast<std::size_t>(lo)];
    for (int64_t i = lo; i < lo + per; ++i) out.stale += params[static_cast<std::size_t>(i)] != 0;
  }
  return out;
}

struct ZeroRun {
  PipeOutcome outcome;  // the parameters gathered whole after the run
  bool sharded = false;  // the engine's parameters are sharded (ZeRO-3 over more than one copy)
  int64_t stepped = 0, stage_size = 0;  // values this rank's optimizer steps; of its stage
  Released released;  // after the run, before the gather
  MemoryEstimate estimate;
};

ZeroRun run_stages(const RunConfig& cfg, std::unique_ptr<Comm> world, int64_t stop_at = -1,
        bool resume = false) {
  Trainer t(cfg, resume, std::move(world));
  t.run(stop_at);
  ZeroRun out;
  out.estimate = t.memory_estimate();
  std::vector<char> stage = stage_values(t);
  const std::vector<char> owned = held_values(t);
  out.stage_size = std::count(stage.begin(), stage.end(), 1);
  for (const OptimPiece& p : t.optimizer().pieces()) out.stepped += p.size;
  out.sharded = cfg.dist.zero == 3 && out.stepped < out.stage_size;
  if (cfg.dist.zero == 3) out.released = released_pages(t, stage);
  t.gather_params();
  out.outcome = finish_pipeline_run(t, cfg.train.run_dir);
  // The values this rank holds: its stage's, but the experts other ranks own.
  for (std::size_t i = 0; i < stage.size(); ++i) stage[i] = stage[i] && owned[i];
  out.outcome.held = stage;
  return out;
}

// After a run the gathered units were all released: the pages a release hands back read 0.
void expect_released(const ZeroRun& r) {
  ASSERT_TRUE(r.sharded) << "the stage's parameters are not sharded: nothing to release";
  EXPECT_GT(r.released.stage_pages, 0) << "no page of the stage's units is outside the shard";
  EXPECT_EQ(r.released.stale, 0) << "values of gathered units stayed after the run";
}

void expect_bitwise(const ZeroRun& got, const ZeroRun& ref, const fs::path& got_dir,
                    const fs::path& ref_dir, int rank) {
  EXPECT_EQ(differ_held(got.outcome.params, ref.outcome.params, got.outcome.held), 0)
      << "stage " << got.outcome.stage << ": parameters differ from ZeRO-2's";
  if (rank != 0) return;
  ASSERT_EQ(got.outcome.losses.size(), static_cast<std::size_t>(kPipeSteps));
  EXPECT_EQ(got.outcome.losses, ref.outcome.losses);
  EXPECT_LE(max_rel(got.outcome.grad_norms, ref.outcome.grad_norms), 1e-12);
  EXPECT_EQ(got.outcome.val_losses, ref.outcome.val_losses);
  const std::string step = "checkpoints/step_00000006";
  EXPECT_TRUE(read_all_tensors(got_dir / step) == read_all_tensors(ref_dir / step))
      << "the ZeRO-3 pipelines' checkpoint differs from ZeRO-2's";
}

// Against the one-process run: bitwise with one pipeline, within the bounds above with two (or
// with tensor-parallel stages).
void expect_follows(const ZeroRun& got, const PipeOutcome& single, bool bitwise, int rank) {
  if (bitwise) {
    EXPECT_EQ(differ_held(got.outcome.params, single.params, got.outcome.held), 0)
        << "stage " << got.outcome.stage << ": parameters differ from the one-process run's";
  } else {
    EXPECT_LE(max_rel_diff_held(got.outcome.params, single.params, got.outcome.held), 1e-4);
  }
  if (rank != 0) return;
  ASSERT_EQ(got.outcome.losses.size(), single.losses.size());
  EXPECT_LE(max_rel(got.outcome.losses, single.losses), bitwise ? 1e-12 : 1e-5);
  EXPECT_LT(got.outcome.losses.back(), got.outcome.losses.front());
  EXPECT_LE(max_rel(got.outcome.grad_norms, single.grad_norms), bitwise ? 1e-12 : 1e-4);
  ASSERT_EQ(got.outcome.val_losses.size(), single.val_losses.size());
  if (bitwise) {
    EXPECT_EQ(got.outcome.val_losses, single.val_losses);
  } else {
    EXPECT_LE(max_rel(got.outcome.val_losses, single.val_losses), 1e-5);
  }
}

// The one-process run with the pipelines' global batch (2 rows a micro-batch a pipeline), on
// every rank (each its own).
PipeOutcome run_single(const SharedDir& dir, int pipelines, int rank,
                       const std::vector<std::string>& extra = {}) {
  std::vector<std::string> keys = extra;
  keys.push_back("train.batch_size=" + std::to_string(2 * pipelines));
  const fs::path run_dir = dir / ("single" + std::to_string(rank));
  Trainer t(pipeline_config(dir / "data", run_dir, 1, "1f1b", 1, keys), false, make_local_comm());
  t.run();
  return finish_pipeline_run(t, run_dir);
}

}  // namespace

// 1f1b, interleaved (2 chunks a stage, each chunk's slots asking for its own units) and
// zero_bubble (its weight passes read no parameter) under ZeRO-3, each against ZeRO-2 under the
// same schedule and keys (bitwise) and the one-process run; on 4 processes also 1f1b without
// overlap, with dist.ep = 2 and in bf16, the gathered units are released after the run, and the
// start-up estimate counts the stage's parameters sharded.
TEST(PipelineZeroThree, StagesEndWhereZeroTwoEndsBitwiseAndFollowTheOneProcessRun) {
  auto world = dist_world("pipeline_zero3");
  const int W = world->size(), r = world->rank();
  SharedDir dir(*world, "pipeline_zero3");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const int pipelines = W / 2;
  const PipeOutcome single = run_single(dir, pipelines, r);
  struct Case {
    std::string name, schedule;
    int64_t vp;
    std::vector<std::string> keys;
  };
  std::vector<Case> cases = {{"1f1b", "1f1b", 1, {}},
                             {"interleaved", "interleaved", 2, {}},
                             {"zero_bubble", "zero_bubble", 1, {}}};
  // Two pipelines: the gathers inline (no communication thread), and the experts sharded over
  // each stage's EP group (its 2 copies: each rank's experts are whole on it, nothing of them
  // gathered).
  if (pipelines > 1) {
    cases.push_back({"1f1b_blocking", "1f1b", 1, {"dist.overlap=false"}});
    cases.push_back({"1f1b_ep", "1f1b", 1, {"dist.ep=2"}});
    // bf16 GEMM operands: each slot's model rounds a unit's weights as it is gathered, the bits
    // ZeRO-2's slots round from their whole copy (compared with ZeRO-2 only).
    cases.push_back({"1f1b_bf16", "1f1b", 1, {"train.precision=bf16"}});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto config = [&](int zero) {
      std::vector<std::string> keys = c.keys;
      keys.push_back("dist.zero=" + std::to_string(zero));
      return pipeline_config(dir / "data", dir / (c.name + std::to_string(zero)), 2, c.schedule,
                             c.vp, keys);
    };
    const ZeroRun two = run_stages(config(2), dist_world("pipeline_zero3_two"));
    const ZeroRun three = run_stages(config(3), dist_world("pipeline_zero3_three"));
    expect_bitwise(three, two, dir / (c.name + "3"), dir / (c.name + "2"), r);
    if (c.name != "1f1b_bf16") expect_follows(three, single, pipelines == 1, r);
    if (pipelines == 1) {
      // One copy a stage: the stage's parameters stay whole, stepped by its one process.
      EXPECT_FALSE(three.sharded);
      EXPECT_EQ(three.stepped, three.stage_size);
      continue;
    }
    expect_released(three);
    // The copies share the stage's parameters (each about half).
    EXPECT_LT(three.stepped, three.stage_size * 3 / 4);
    EXPECT_GT(three.stepped, three.stage_size / 4);
    // The start-up estimate: the stage's parameters sharded (ZeRO-2 holds them whole), its
    // gradients the stage's under both, reduced once a step.
    EXPECT_LT(three.estimate.parameters, two.estimate.parameters);
    EXPECT_EQ(three.estimate.gradients, two.estimate.gradients);
  }
}

// dist.pp = 2 × dist.tp = 2 on 4 processes (ranks stage · 2 + t; a stage's copies are its two
// tensor-parallel ranks, which ZeRO-3 shards its parameters over): against ZeRO-2 in the same
// stages (bitwise: a sum of the two ranks' terms, as above) and the one-process run
// (pipeline_tp_test.cpp's bounds); the gathered units are released after the run.
TEST(PipelineZeroThree, TensorParallelStagesFollowTheOneProcessRun) {
  auto world = dist_world("pipeline_zero3_tp");
  const int W = world->size(), r = world->rank();
  if (W != 4) GTEST_SKIP() << "dist.pp = 2 × dist.tp = 2 runs on 4 processes; this run has " << W;
  SharedDir dir(*world, "pipeline_zero3_tp");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const PipeOutcome single = run_single(dir, 1, r);
  auto config = [&](int zero) {
    return pipeline_config(dir / "data", dir / ("tp" + std::to_string(zero)), 2, "1f1b", 1,
                           {"dist.zero=" + std::to_string(zero), "dist.tp=2"});
  };
  const ZeroRun two = run_stages(config(2), dist_world("pipeline_zero3_tp_two"));
  const ZeroRun three = run_stages(config(3), dist_world("pipeline_zero3_tp_three"));
  EXPECT_EQ(three.outcome.stage, r / 2);
  expect_bitwise(three, two, dir / "tp3", dir / "tp2", r);
  expect_follows(three, single, false, r);
  expect_released(three);
}

// A ZeRO-3 pipeline stopped after step 5 of 10 and resumed from that checkpoint ends where the
// straight run ends, bit for bit; the checkpoint holds the whole model (each tensor gathered by
// its writer), which one process loads (keeping the global batch with more micro-batches when
// there were two pipelines): the stopped run's parameters, bit for bit.
TEST(PipelineZeroThree, ResumesBitExactAndTheCheckpointLoadsOnOneProcess) {
  auto world = dist_world("pipeline_zero3_resume");
  const int r = world->rank();
  SharedDir dir(*world, "pipeline_zero3_resume");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  auto config = [&](const fs::path& run_dir, int64_t pp) {
    return pipeline_config(dir / "data", run_dir, pp, "1f1b", 1,
                           {"dist.zero=3", "train.steps=10", "train.checkpoint_every=5"});
  };
  const ZeroRun straight =
      run_stages(config(dir / "straight", 2), dist_world("pipeline_zero3_straight"));
  const ZeroRun stopped =
      run_stages(config(dir / "stopped", 2), dist_world("pipeline_zero3_stopped"), 5);
  if (r == 0) copy_checkpoint(dir.path(), "stopped", "resumed", 5);
  world->barrier();
  const ZeroRun resumed =
      run_stages(config(dir / "resumed", 2), dist_world("pipeline_zero3_resumed"), -1, true);
  EXPECT_EQ(differ_held(resumed.outcome.params, straight.outcome.params, resumed.outcome.held), 0)
      << "the ZeRO-3 pipelines resumed at step 5 differ from the straight run";
  if (r == 0) {
    ASSERT_EQ(straight.outcome.losses.size(), 10u);
    EXPECT_EQ(resumed.outcome.losses, straight.outcome.losses);
  }
  // The step-5 checkpoint: the stopped run's values, and one process resumes from them.
  const fs::path ckpt = dir / "stopped/checkpoints/step_00000005";
  const LoadedModel at5 = load_model(ckpt);
  EXPECT_EQ(at5.step, 5);
  ASSERT_EQ(at5.params.size(), stopped.outcome.params.size());
  EXPECT_EQ(differ_held(at5.params, stopped.outcome.params, stopped.outcome.held), 0)
      << "the checkpoint differs from the values their holders stepped";
  TempDir back("pipeline_zero3_back");
  fs::create_directories(back.path() / "checkpoints");
  fs::copy(ckpt, back.path() / "checkpoints/step_00000005");
  std::ofstream(back.path() / "checkpoints/latest") << "step_00000005";
  fs::copy_file(dir / "stopped/metrics.jsonl", back.path() / "metrics.jsonl");
  Trainer one(config(back.path(), 1), true, make_local_comm());
  EXPECT_EQ(one.step(), 5);
  ASSERT_EQ(one.params().size(), at5.params.size());
  EXPECT_EQ(0, std::memcmp(one.params().data(), at5.params.data(),
                           at5.params.size() * sizeof(float)));
  one.run();
  EXPECT_EQ(one.step(), 10);
}
