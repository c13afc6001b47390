// The interleaved pipeline schedule (dist.pp_schedule = interleaved, dist.vp chunks a stage)
// against the one-process run with the same global batch and seed: 2 stages of 2 chunks over the
// model's 4 blocks (stage 0 holds blocks 0 and 2 with the embedding, stage 1 blocks 1 and 3 with
// the head), on 2 processes as one pipeline and on 4 as two.
//
// Bitwise where the code path is the same: each chunk runs its blocks' forward and backward as
// the whole model does (Transformer::set_stage), every schedule runs a chunk's backwards in
// ascending micro-batch order, so each parameter gradient accumulates over the micro-batches in
// the one-process order; AdamW is elementwise, so with the clip off the parameters, the
// checkpointed tensors and the validation losses (the last chunk's cross-entropy, summed with
// the other chunks' zeros) have the one-process bits. Not bitwise: the training loss and the
// gradient norm, whose parts are summed per chunk, per stage and then over the stages (double
// sums of a few hundred terms regrouped), so 1e-12 relative bounds them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "io/trace_events.h"
#include "parallel/runtime.h"
#include "support/checkpoint_tensors.h"
#include "support/corpus.h"
#include "support/held_values.h"
#include "support/run_metrics.h"
#include "support/shared_dir.h"
#include "support/temp_dir.h"
#include "parallel/pipeline_runs.h"  // tests/parallel/pipeline_runs.h
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kSteps = kPipeSteps, kAccum = kPipeAccum;
using Outcome = PipeOutcome;

// pp = 1: the one-process run.
RunConfig make_config(const fs::path& data, const fs::path& run, int64_t pp, int64_t vp,
                      std::vector<std::string> extra = {}) {
  return pipeline_config(data, run, pp, pp > 1 ? "interleaved" : "1f1b", vp, extra);
}

Outcome finish(Trainer& t, const fs::path& run) { return finish_pipeline_run(t, run); }

Outcome run(const RunConfig& cfg, std::unique_ptr<Comm> comm, bool resume = false) {
  Trainer t(cfg, resume, std::move(comm));
  t.run();
  return finish(t, cfg.train.run_dir);
}

// Copies run `from`'s step-3 checkpoint and metrics into a fresh run directory `to` (rank 0).
void start_from_step3(const fs::path& from, const fs::path& to) {
  fs::create_directories(to / "checkpoints");
  fs::copy(from / "checkpoints/step_00000003", to / "checkpoints/step_00000003");
  std::ofstream(to / "checkpoints/latest") << "step_00000003";
  fs::copy_file(from / "metrics.jsonl", to / "metrics.jsonl");
}

}  // namespace

TEST(PipelineInterleaved, TwoStagesOfTwoChunksFollowTheOneProcessRunBitwise) {
  auto world = dist_world("interleaved");
  const int W = world->size(), r = world->rank();
  if (W != 2) GTEST_SKIP() << "needs 2 processes for one pipeline of 2 stages";
  SharedDir dir(*world, "interleaved");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const fs::path single_run = dir / ("single" + std::to_string(r));
  const Outcome single = run(make_config(dir / "data", single_run, 1, 1), make_local_comm());

  const fs::path piped_run = dir / "interleaved";
  Trainer t(make_config(dir / "data", piped_run, 2, 2), false, dist_world("interleaved_run"));
  t.run();
  const Outcome piped = finish(t, piped_run);
  const PipelineRunner* pipe = t.pipeline();
  ASSERT_NE(pipe, nullptr);
  EXPECT_EQ(pipe->chunks_per_stage(), 2);
  // Two ranges a stage: its chunks are not neighbours.
  EXPECT_EQ(pipe_stage_params(t.model(), 2, 2, pipe->stage()).size(), 2u);
  EXPECT_EQ(differ_held(piped.params, single.params, piped.held), 0)
      << "stage " << pipe->stage() << ": parameters differ from the one-process run's";
  EXPECT_EQ(pipe->slots_made(), pipe->slots(kAccum));
  // The comparison can fail: one process at another seed ends elsewhere on this stage's values.
  const fs::path other_run = dir / ("other_seed" + std::to_string(r));
  const Outcome other =
      run(make_config(dir / "data", other_run, 1, 1, {"train.seed=99"}), make_local_comm());
  EXPECT_GT(differ_held(piped.params, other.params, piped.held), 0);
  expect_pipe_follows_single(piped, single, r);
  if (r == 0) {
    // The last step as it ran: each stage's passes in the interleaved order, named with their
    // chunk, one at a time.
    expect_trace_follows_schedule(piped_run / kPipelineTraceFile, PipeSchedule::Interleaved,
                                  {2, kAccum, 2});
    // The checkpoint holds the one-process checkpoint's tensors, bit for bit, each written by
    // the stage holding it.
    const std::string step = "checkpoints/step_00000006";
    const auto mine = read_all_tensors(piped_run / step);
    EXPECT_GT(mine.size(), 10u);
    EXPECT_TRUE(mine == read_all_tensors(single_run / step))
        << "the interleaved pipeline's checkpoint differs from the one-process run's";
    start_from_step3(single_run, dir / "resumed");
  }
  world->barrier();
  // The one-process step-3 checkpoint resumed by the interleaved pipeline: the one-process bits.
  const Outcome resumed =
      run(make_config(dir / "data", dir / "resumed", 2, 2), dist_world("resumed"), true);
  EXPECT_EQ(differ_held(resumed.params, single.params, resumed.held), 0)
      << "the interleaved pipeline resumed from a one-process checkpoint differs";
  // And the pipeline's step-3 checkpoint resumed by one process (a layout without stages).
  TempDir back("interleaved_back");
  start_from_step3(piped_run, back.path());
  const Outcome one = run(make_config(dir / "data", back.path(), 1, 1), make_local_comm(), true);
  EXPECT_EQ(0, std::memcmp(one.params.data(), single.params.data(),
                           single.params.size() * sizeof(float)))
      << "one process resumed from the interleaved pipeline's checkpoint differs";
}

// Two pipelines of 2 stages × 2 chunks on 4 processes: each stage's two copies reduce their
// gradients as data parallelism does, which sums them in another order than the one-process
// backward sums the rows (as pipeline_test.cpp's two pipelines): float rounding, amplified over
// 6 AdamW steps, within the bounds that test uses. ZeRO-1 with overlap steps each element on one
// copy with the same elementwise update of the same two-term sum (the same buckets reduced by
// the same calls, on the communication thread during the last backward), then gathers it: the
// bits of the run without either.
TEST(PipelineInterleaved, TwoPipelinesFollowTheOneProcessRun) {
  auto world = dist_world("interleaved_dp");
  const int W = world->size(), r = world->rank();
  if (W != 4) GTEST_SKIP() << "needs 4 processes for 2 pipelines x 2 stages";
  SharedDir dir(*world, "interleaved_dp");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const Outcome single = run(make_config(dir / "data", dir / ("single" + std::to_string(r)), 1, 1,
                                         {"train.batch_size=4"}),
                             make_local_comm());
  const fs::path plain_run = dir / "dp";
  const Outcome got = run(make_config(dir / "data", plain_run, 2, 2, {"dist.overlap=false"}),
                          dist_world("interleaved_dp_run"));
  double worst = 0, scale = 1e-30;
  for (std::size_t i = 0; i < got.params.size(); ++i) {
    if (!got.held[i]) continue;
    worst = std::max(worst, std::abs(double(got.params[i]) - single.params[i]));
    scale = std::max(scale, std::abs(double(single.params[i])));
  }
  EXPECT_LE(worst / scale, 1e-4);
  if (r == 0) {
    ASSERT_EQ(got.losses.size(), static_cast<std::size_t>(kSteps));
    EXPECT_LE(max_rel(got.losses, single.losses), 1e-5);
    EXPECT_LE(max_rel(got.val_losses, single.val_losses), 1e-5);
    EXPECT_LE(max_rel(got.grad_norms, single.grad_norms), 1e-4);
  }
  const fs::path zrun = dir / "dp_zero1_overlap";
  const Outcome sharded = run(make_config(dir / "data", zrun, 2, 2, {"dist.zero=1"}),
                              dist_world("interleaved_dp_zero1"));
  EXPECT_EQ(differ_held(sharded.params, got.params, got.held), 0)
      << "ZeRO-1 with overlap: stage parameters differ from the run without them";
  if (r == 0) {
    EXPECT_LE(max_rel(metric(zrun, "loss"), got.losses), 1e-12);
    const std::string step = "checkpoints/step_00000006";
    EXPECT_TRUE(read_all_tensors(zrun / step) == read_all_tensors(plain_run / step))
        << "the ZeRO-1 pipelines' checkpoint differs from the pipelines' without it";
  }
}

// Interleaved stages running expert parallelism (dist.pp = 2, dist.vp = 2, dist.ep = 2 on 4
// processes: each stage's two copies are one EP group) against dist.ep = 2 on 2 processes
// without stages, the same global batch and seed. Bitwise, as pipeline_test.cpp argues for
// 1f1b: copy c of a stage reads what rank c reads without stages, every chunk's MoE layers route
// the same tokens over an EP group of the same two ranks (both copies run the same list of
// passes, so their exchanges come in the same order), each gradient accumulates in micro-batch
// order and the dense ones sum over two copies as over two ranks (overlap reduces the same
// buckets with the same calls); AdamW is elementwise.
TEST(PipelineInterleaved, ExpertParallelChunksFollowTheExpertParallelRunBitwise) {
  auto world = dist_world("interleaved_ep");
  const int W = world->size(), r = world->rank();
  if (W != 4) GTEST_SKIP() << "needs 4 processes for 2 pipelines x 2 stages, dist.ep = 2";
  SharedDir dir(*world, "interleaved_ep");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  dist_local_size();  // found collectively over every process, before a trainer runs on half
  auto half = world->split(r / 2, r % 2, {"half"});
  // dist.a2a_chunks = 2 cuts each exchange in two on the communication thread, both with and
  // without stages: the stages' copies run the chunks as the ranks without stages do.
  for (const std::string chunks : {"1", "2"}) {
    SCOPED_TRACE("dist.a2a_chunks = " + chunks);
    const std::vector<std::string> keys = {"dist.ep=2", "dist.a2a_chunks=" + chunks};
    const fs::path ref_dir = dir / ("ep_chunks" + chunks);
    auto ref_file = [&](int c) {
      return dir / ("ref_params" + chunks + "_" + std::to_string(c) + ".bin");
    };
    if (r < 2) {
      Trainer t(make_config(dir / "data", ref_dir, 1, 1, keys), false, half->dup("ep_run"));
      t.run();
      std::ofstream(ref_file(r), std::ios::binary)
          .write(reinterpret_cast<const char*>(t.params().data()),
                 static_cast<std::streamsize>(t.params().size() * sizeof(float)));
    }
    world->barrier();
    const fs::path run_dir = dir / ("pp_ep_chunks" + chunks);
    Trainer t(make_config(dir / "data", run_dir, 2, 2, keys), false,
              dist_world("interleaved_ep_run"));
    t.run();
    const Outcome got = finish(t, run_dir);
    const PipelineRunner* pipe = t.pipeline();
    ASSERT_NE(pipe, nullptr);
    std::vector<char> held = held_values(t);
    for (std::size_t i = 0; i < held.size(); ++i) held[i] &= got.held[i];
    std::vector<float> ref(t.params().size());
    std::ifstream(ref_file(static_cast<int>(pipe->replica())), std::ios::binary)
        .read(reinterpret_cast<char*>(ref.data()),
              static_cast<std::streamsize>(ref.size() * sizeof(float)));
    EXPECT_EQ(differ_held(got.params, ref, held), 0)
        << "stage " << pipe->stage() << " copy " << pipe->replica()
        << ": parameters differ from the run without stages";
    if (r == 0) {
      EXPECT_LE(max_rel(got.losses, metric(ref_dir, "loss")), 1e-12);
      EXPECT_EQ(got.val_losses, metric(ref_dir, "val_loss"));
      const std::string step = "checkpoints/step_00000006";
      const auto mine = read_all_tensors(run_dir / step);
      EXPECT_GT(mine.size(), 10u);
      EXPECT_TRUE(mine == read_all_tensors(ref_dir / step))
          << "the interleaved pp x ep checkpoint differs from the run without stages'";
    }
    world->barrier();
  }
}

// What the interleaved schedule cannot run, refused naming the key before anything is written:
// chunks a stage under another schedule, more chunks than blocks, micro-batches that are not a
// multiple of the stages.
TEST(PipelineInterleaved, RefusesChunksItCannotRun) {
  auto world = dist_world("interleaved_refuse");
  SharedDir dir(*world, "interleaved_refuse");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"dist.pp_schedule=1f1b"}, "dist.vp = 2"},
      {{"dist.pp_schedule=gpipe"}, "dist.vp = 2"},
      {{"dist.vp=3"}, "dist.vp = 3"},
      {{"train.grad_accum=3"}, "train.grad_accum = 3"}};
  for (const auto& [keys, named] : cases) {
    SCOPED_TRACE(named);
    const fs::path run_dir = dir / "refused";
    try {
      Trainer t(make_config(dir / "data", run_dir, 2, 2, keys), false, dist_world("refused"));
      ADD_FAILURE() << "not refused";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
    }
    world->barrier();
    EXPECT_FALSE(fs::exists(run_dir)) << "a refused run wrote " << run_dir;
  }
}

// zero_bubble with 2 chunks a stage (dist.vp = 2: 2 stages over the 4 blocks, stage 0 blocks 0
// and 2 with the embedding, stage 1 blocks 1 and 3 with the head) ends where interleaved at
// vp = 2 ends, bit for bit: both run the same forwards in the same order on each stage (the
// weight passes are only put between them), every parameter belongs to one chunk, and a chunk's
// B passes (its MoE layers' and norms' gradients) and W passes (its dense linears' weight
// gradients: the GEMM calls backward makes, deferred) each run in ascending micro-batch order,
// as interleaved's backwards do, so each parameter gradient is the same sum in the same order.
// The training losses and norms are the same forwards' and gradients' parts summed in the same
// order. Against the one-process run it is bitwise as interleaved is
// (expect_pipe_follows_single).
TEST(PipelineInterleaved, ZeroBubbleWithChunksEndsWhereInterleavedEnds) {
  auto world = dist_world("pipeline_zb_vp");
  const int W = world->size(), r = world->rank();
  if (W != 2) GTEST_SKIP() << "needs 2 processes for one pipeline of 2 stages x 2 chunks";
  SharedDir dir(*world, "pipeline_zb_vp");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const std::string single_dir = "single" + std::to_string(r);
  const Outcome single = run(make_config(dir / "data", dir / single_dir, 1, 1), make_local_comm());
  auto run_chunks = [&](const std::string& schedule, const fs::path& run, bool resume) {
    Trainer t(pipeline_config(dir / "data", run, 2, schedule, 2), resume,
              dist_world("pipeline_zb_vp_run"));
    t.run();
    const PipelineRunner* pipe = t.pipeline();
    EXPECT_TRUE(pipe && pipe->chunks_per_stage() == 2 && pipe->slots_made() == pipe->slots(kAccum));
    return finish(t, run);
  };
  const Outcome inter = run_chunks("interleaved", dir / "interleaved", false);
  const Outcome zb = run_chunks("zero_bubble", dir / "zero_bubble", false);
  EXPECT_EQ(zb.params, inter.params) << "zero_bubble at vp = 2 ends elsewhere than interleaved";
  expect_pipe_follows_single(zb, single, r);
  if (r == 0) {
    EXPECT_EQ(zb.losses, inter.losses);
    EXPECT_EQ(zb.grad_norms, inter.grad_norms);
    // The last step as it ran: each stage's passes in the schedule's order, one at a time, the
    // weight passes named with their chunk (W3.c2).
    int64_t weights = 0;
    expect_trace_follows_schedule(dir / "zero_bubble" / kPipelineTraceFile,
                                  PipeSchedule::ZeroBubble, {2, kAccum, 2}, &weights);
    EXPECT_EQ(weights, 4 * kAccum) << "a weight pass of each micro-batch on each chunk";
    const std::string step = "checkpoints/step_00000006";
    const auto mine = read_all_tensors(dir / ("zero_bubble/" + step));
    EXPECT_GT(mine.size(), 10u);
    EXPECT_TRUE(mine == read_all_tensors(dir / (single_dir + "/" + step)))
        << "the zero_bubble vp = 2 checkpoint differs from the one-process run's";
    // The one-process step-3 checkpoint, to resume from.
    start_from_step3(dir / "single0", dir / "resumed");
  }
  world->barrier();
  const Outcome resumed = run_chunks("zero_bubble", dir / "resumed", true);
  EXPECT_EQ(differ_held(resumed.params, single.params, resumed.held), 0)
      << "zero_bubble at vp = 2 resumed from a one-process checkpoint differs";
}
