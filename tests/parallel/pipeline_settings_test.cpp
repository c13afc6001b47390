// Settings the one-process and data-parallel trainers run, in pipeline stages (dist.pp = 2 on 2
// processes as one pipeline, on 4 as two), each against the same layout without the setting:
// activation recomputation in every activation slot; ZeRO-2 over a stage's copies; the 2-D
// expert all-to-all inside a stage's EP group.
//
// Bitwise where the code path is the same: recomputation computes each block's activations
// again with the same operations on the same inputs (Transformer::set_recompute: the gradients
// are the same bits in every mode), in each slot's own model, so the stages' gradients, the
// parameters, the losses and the checkpointed tensors have the bits of the run that keeps every
// activation.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "parallel/runtime.h"
#include "support/checkpoint_tensors.h"
#include "support/corpus.h"
#include "support/held_values.h"
#include "support/run_metrics.h"
#include "support/shared_dir.h"
#include "parallel/pipeline_runs.h"  // tests/parallel/pipeline_runs.h
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kSteps = kPipeSteps;

struct StageRun {
  PipeOutcome outcome;
  Recompute recompute = Recompute::None;  // the stage's model's (slot 0 of its first chunk)
  int64_t nonzero_grads = 0;              // of the stage's values, after the run
};

StageRun run_pipe(const fs::path& data, const fs::path& run, const std::string& schedule, int64_t vp,
             const std::vector<std::string>& extra, bool resume = false) {
  Trainer t(pipeline_config(data, run, 2, schedule, vp, extra), resume,
            dist_world("pipeline_settings_run"));
  t.run();
  StageRun out;
  out.outcome = finish_pipeline_run(t, run);
  out.recompute = t.model().recompute();
  for (std::size_t i = 0; i < out.outcome.held.size(); ++i)
    out.nonzero_grads += out.outcome.held[i] && t.grads()[i] != 0.0f;
  return out;
}

}  // namespace

// train.recompute = moe and full in the stages of 1f1b, of interleaved (2 chunks a stage) and
// (moe only: full keeps one set of block activations, which the deferred weight passes would
// read overwritten) of zero_bubble, against recompute = none under the same schedule; on 4
// processes also with dist.ep = 2 inside the stages, where full exchanges each MoE layer's rows
// again in the backward (every copy of a stage recomputes the same blocks in the same order).
TEST(PipelineSettings, RecomputeInStagesEndsWhereKeepingEveryActivationEndsBitwise) {
  auto world = dist_world("pipeline_recompute");
  const int W = world->size(), r = world->rank();
  SharedDir dir(*world, "pipeline_recompute");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  struct Case {
    std::string name, schedule;
    int64_t vp;
    std::vector<std::string> modes, keys;
  };
  std::vector<Case> cases = {{"1f1b", "1f1b", 1, {"moe", "full"}, {}},
                             {"interleaved", "interleaved", 2, {"moe", "full"}, {}},
                             {"zero_bubble", "zero_bubble", 1, {"moe"}, {}}};
  if (W == 4) cases.push_back({"1f1b_ep", "1f1b", 1, {"full"}, {"dist.ep=2"}});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto keys = [&](const std::string& mode) {
      std::vector<std::string> k = c.keys;
      k.push_back("train.recompute=" + mode);
      return k;
    };
    const fs::path kept_run = dir / (c.name + "_none");
    const StageRun kept = run_pipe(dir / "data", kept_run, c.schedule, c.vp, keys("none"));
    for (const std::string& mode : c.modes) {
      SCOPED_TRACE(mode);
      const fs::path run = dir / (c.name + "_" + mode);
      const StageRun got = run_pipe(dir / "data", run, c.schedule, c.vp, keys(mode));
      EXPECT_EQ(differ_held(got.outcome.params, kept.outcome.params, got.outcome.held), 0)
          << "stage " << got.outcome.stage << ": parameters differ from recompute = none";
      // The setting reached the stage's model (the other slots copy it). Its activation bytes
      // are no witness at this size: the recompute scratch outweighs what it saves.
      EXPECT_EQ(recompute_name(got.recompute), mode);
      if (r != 0) continue;
      ASSERT_EQ(got.outcome.losses.size(), static_cast<std::size_t>(kSteps));
      EXPECT_EQ(got.outcome.losses, kept.outcome.losses);
      EXPECT_EQ(got.outcome.grad_norms, kept.outcome.grad_norms);
      EXPECT_EQ(got.outcome.val_losses, kept.outcome.val_losses);
      const std::string step = "checkpoints/step_00000006";
      EXPECT_TRUE(read_all_tensors(run / step) == read_all_tensors(kept_run / step))
          << "the checkpoint differs from recompute = none's";
    }
  }
}

// dist.zero = 2 over each stage's two copies (4 processes: 2 pipelines of 2 stages) against
// dist.zero = 1 in the same layout. A stage's gradient buckets are final only after its last
// backward (zero_bubble: its last weight pass), so ZeRO-2 reduce-scatters them once a step, then,
// as ZeRO-1 does, steps the shard and gathers the parameters: the same reduction of the same
// accumulated gradients (each element a sum of two terms, which rounds alike in either order and
// under any bucketing), the same elementwise update. So with the clip off the parameters, the
// losses, the validation losses and the checkpoint are ZeRO-1's bits under each schedule and
// chunking, with overlap and without; the gradient norm sums the shards' squares in another grouping (1e-12 relative). The
// reduced buckets are cleared, so no gradient is left in the flat buffer (ZeRO-1 leaves them).
// A run resumed from its step-3 checkpoint ends bitwise where the straight run ends.
TEST(PipelineSettings, ZeroTwoInStagesEndsWhereZeroOneEndsBitwise) {
  auto world = dist_world("pipeline_zero2");
  const int W = world->size(), r = world->rank();
  if (W != 4) GTEST_SKIP() << "needs 4 processes for 2 pipelines x 2 stages";
  SharedDir dir(*world, "pipeline_zero2");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const StageRun zero1 = run_pipe(dir / "data", dir / "zero1", "1f1b", 1, {"dist.zero=1"});
  EXPECT_GT(zero1.nonzero_grads, 0) << "ZeRO-1 keeps its gradients: the check below can fail";
  struct Case {
    std::string name, schedule;
    int64_t vp;
    std::vector<std::string> keys;
  };
  // zero_bubble ends where 1f1b ends (pipeline_test.cpp), so 1f1b's ZeRO-1 run is its
  // reference too; interleaved and the stages with dist.ep = 2 have their own.
  const std::vector<Case> cases = {
      {"1f1b", "1f1b", 1, {"dist.zero=2"}},
      {"1f1b_blocking", "1f1b", 1, {"dist.zero=2", "dist.overlap=false"}},
      {"zero_bubble", "zero_bubble", 1, {"dist.zero=2"}},
      {"interleaved", "interleaved", 2, {"dist.zero=2"}},
      {"1f1b_ep", "1f1b", 1, {"dist.zero=2", "dist.ep=2"}}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const bool own_ref = c.name == "interleaved" || c.name == "1f1b_ep";
    const std::string ref_name = own_ref ? c.name + "_zero1" : "zero1";
    std::vector<std::string> ref_keys = c.keys;
    ref_keys.front() = "dist.zero=1";
    const StageRun ref =
        own_ref ? run_pipe(dir / "data", dir / ref_name, c.schedule, c.vp, ref_keys) : zero1;
    const StageRun got = run_pipe(dir / "data", dir / c.name, c.schedule, c.vp, c.keys);
    EXPECT_EQ(differ_held(got.outcome.params, ref.outcome.params, got.outcome.held), 0)
        << "stage " << got.outcome.stage << ": parameters differ from ZeRO-1's";
    EXPECT_EQ(got.nonzero_grads, 0) << "ZeRO-2 left reduced gradients in the flat buffer";
    if (r != 0) continue;
    ASSERT_EQ(got.outcome.losses.size(), static_cast<std::size_t>(kSteps));
    EXPECT_EQ(got.outcome.losses, ref.outcome.losses);
    EXPECT_LE(max_rel(got.outcome.grad_norms, ref.outcome.grad_norms), 1e-12);
    EXPECT_EQ(got.outcome.val_losses, ref.outcome.val_losses);
    const std::string step = "checkpoints/step_00000006";
    EXPECT_TRUE(read_all_tensors(dir / c.name / step) == read_all_tensors(dir / ref_name / step))
        << "the ZeRO-2 pipelines' checkpoint differs from ZeRO-1's";
  }
  // Resumed from its own step-3 checkpoint (the optimizer state as ZeRO-2's shards wrote it).
  if (r == 0) copy_checkpoint(dir.path(), "1f1b", "resumed", 3);
  world->barrier();
  const StageRun resumed =
      run_pipe(dir / "data", dir / "resumed", "1f1b", 1, {"dist.zero=2"}, /*resume=*/true);
  EXPECT_EQ(differ_held(resumed.outcome.params, zero1.outcome.params, resumed.outcome.held), 0)
      << "the ZeRO-2 pipelines resumed at step 3 differ from the straight run";
}

// dist.hierarchical = true inside the stages (4 processes: 2 pipelines of 2 stages, dist.ep = 2:
// each stage's two copies are one EP group) against the flat all-to-all in the same layout. The
// 2-D route delivers the same rows in the same order (tests/parallel/train_test.cpp), so the
// parameters, losses, norms and checkpoint are the flat route's bits. dist.ranks_per_node counts
// a node's processes: 2 a node puts the stage's two copies on two nodes (world ranks s and 2 + s),
// so rows cross nodes; 4 puts them on one, so none do (the flat route's count under the same
// setting); 0 detects this machine's processes, every one on one node.
TEST(PipelineSettings, TwoDimensionalAllToAllInStagesEndsWhereTheFlatOneEndsBitwise) {
  auto world = dist_world("pipeline_2d");
  const int W = world->size(), r = world->rank();
  if (W != 4) GTEST_SKIP() << "needs 4 processes for 2 pipelines x 2 stages with dist.ep = 2";
  SharedDir dir(*world, "pipeline_2d");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const StageRun flat = run_pipe(dir / "data", dir / "flat", "1f1b", 1, {"dist.ep=2"});
  // 0: detected, one machine (every copy on one node).
  for (const int64_t node : {2, 4, 0}) {
    SCOPED_TRACE(node);
    const std::string name = "two_d_" + std::to_string(node);
    const StageRun got = run_pipe(
        dir / "data", dir / name, "1f1b", 1,
        {"dist.ep=2", "dist.hierarchical=true", "dist.ranks_per_node=" + std::to_string(node)});
    EXPECT_EQ(differ_held(got.outcome.params, flat.outcome.params, got.outcome.held), 0)
        << "stage " << got.outcome.stage << ": parameters differ from the flat route's";
    if (r != 0) continue;
    EXPECT_EQ(got.outcome.losses, flat.outcome.losses);
    EXPECT_EQ(got.outcome.grad_norms, flat.outcome.grad_norms);
    EXPECT_EQ(got.outcome.val_losses, flat.outcome.val_losses);
    const std::string step = "checkpoints/step_00000006";
    EXPECT_TRUE(read_all_tensors(dir / name / step) == read_all_tensors(dir / "flat" / step))
        << "the 2-D route's checkpoint differs from the flat route's";
    const std::vector<double> crossed = metric(dir / name, "a2a_cross_node_bytes");
    ASSERT_EQ(crossed.size(), static_cast<std::size_t>(kSteps));
    if (node == 2) {
      EXPECT_GT(crossed.front(), 0) << "the stage's copies are on two nodes";
    } else {
      EXPECT_EQ(crossed, std::vector<double>(crossed.size(), 0.0))
          << "the stage's copies are on one node";
    }
  }
}

// train.precision = fp16 in a pipeline of every process (dist.pp = 2 or 4, 1f1b) against the
// one-process fp16 run. Every activation slot rounds the same f32 weights to fp16 and runs the
// same GEMMs as the one-process model on its blocks, the gradients accumulate in the same
// micro-batch order, and the overflow check is agreed over every stage (the world), so the
// loss scaler skips the same steps and the parameters, the scales and the checkpoint are the
// one-process bits. A first scale of 2^24 overflows the fp16 GEMM operands: steps are skipped.
// The one-process step-3 checkpoint, loss scale included, resumes in the pipeline bitwise.
TEST(PipelineSettings, FloatSixteenInStagesFollowsTheOneProcessRunBitwise) {
  auto world = dist_world("pipeline_fp16");
  const int W = world->size(), r = world->rank();
  SharedDir dir(*world, "pipeline_fp16");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const std::vector<std::string> keys = {"train.precision=fp16", "train.loss_scale_init=16777216",
                                         "train.loss_scale_growth_interval=2"};
  const fs::path single_run = dir / ("single" + std::to_string(r));
  Trainer one(pipeline_config(dir / "data", single_run, 1, "1f1b", 1, keys), false,
              make_local_comm());
  one.run();
  const PipeOutcome single = finish_pipeline_run(one, single_run);
  const fs::path run = dir / "piped";
  Trainer t(pipeline_config(dir / "data", run, W, "1f1b", 1, keys), false,
            dist_world("pipeline_fp16_run"));
  t.run();
  const PipeOutcome piped = finish_pipeline_run(t, run);
  EXPECT_EQ(differ_held(piped.params, single.params, piped.held), 0)
      << "stage " << piped.stage << ": parameters differ from the one-process fp16 run's";
  // The one-process step-3 checkpoint (its loss scale with it) resumed by the pipeline.
  if (r == 0) copy_checkpoint(dir.path(), "single0", "resumed", 3);
  world->barrier();
  {
    const fs::path resumed_run = dir / "resumed";
    Trainer back(pipeline_config(dir / "data", resumed_run, W, "1f1b", 1, keys), true,
                 dist_world("pipeline_fp16_resumed"));
    back.run();
    const PipeOutcome resumed = finish_pipeline_run(back, resumed_run);
    EXPECT_EQ(differ_held(resumed.params, single.params, resumed.held), 0)
        << "the pipeline resumed from the one-process fp16 checkpoint differs";
  }
  if (r != 0) return;
  // Each step's skip flag (a JSON boolean).
  auto skips = [](const fs::path& dir_) {
    std::vector<bool> out;
    std::ifstream in(dir_ / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("skipped")) out.push_back(j["skipped"].get<bool>());
    }
    return out;
  };
  const std::vector<bool> skipped = skips(run);
  ASSERT_EQ(skipped.size(), static_cast<std::size_t>(kSteps));
  EXPECT_EQ(skipped, skips(single_run));
  EXPECT_GT(std::count(skipped.begin(), skipped.end(), true), 0) << "no step overflowed";
  EXPECT_LT(std::count(skipped.begin(), skipped.end(), true), kSteps) << "every step overflowed";
  EXPECT_EQ(metric(run, "loss_scale"), metric(single_run, "loss_scale"));
  EXPECT_LE(max_rel(piped.losses, single.losses), 1e-12);
  EXPECT_EQ(piped.val_losses, single.val_losses);
  const std::string step = "checkpoints/step_00000006";
  EXPECT_TRUE(read_all_tensors(run / step) == read_all_tensors(single_run / step))
      << "the pipeline's fp16 checkpoint differs from the one-process run's";
}

// model.router_controller = rl in a pipeline of every process (dist.pp = 2 or 4, 1f1b) against
// the one-process run. Each stage's slots count their layers' routing into the trainer's model,
// every rank sums the counts over the world (other stages' layers add zeros) and feeds every
// layer's controller the same figures, drawing the same actions from (seed, step, layer), as the
// one process does. The controller learns from the step time, which no two runs share, so the
// policy and the baseline are held (gating.lr = gating.baseline_lr = 0): the actions then depend
// on the loads and the draws alone, and the biases, the parameters and the checkpointed tensors
// are the one-process bits.
TEST(PipelineSettings, RlRouterControllerInStagesFollowsTheOneProcessRunBitwise) {
  auto world = dist_world("pipeline_rl");
  const int W = world->size(), r = world->rank();
  SharedDir dir(*world, "pipeline_rl");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const std::vector<std::string> keys = {"model.router=sigmoid_bias",
                                         "model.router_controller=rl", "gating.lr=0",
                                         "gating.baseline_lr=0"};
  const fs::path single_run = dir / ("single" + std::to_string(r));
  Trainer one(pipeline_config(dir / "data", single_run, 1, "1f1b", 1, keys), false,
              make_local_comm());
  one.run();
  const PipeOutcome single = finish_pipeline_run(one, single_run);
  const fs::path run = dir / "piped";
  Trainer t(pipeline_config(dir / "data", run, W, "1f1b", 1, keys), false,
            dist_world("pipeline_rl_run"));
  t.run();
  const PipeOutcome piped = finish_pipeline_run(t, run);
  EXPECT_EQ(differ_held(piped.params, single.params, piped.held), 0)
      << "stage " << piped.stage << ": parameters differ from the one-process run's";
  if (r != 0) return;
  EXPECT_LE(max_rel(piped.losses, single.losses), 1e-12);
  EXPECT_EQ(piped.val_losses, single.val_losses);
  const std::string step = "checkpoints/step_00000006";
  const auto mine = read_all_tensors(run / step);
  const auto ref = read_all_tensors(single_run / step);
  EXPECT_TRUE(mine == ref) << "the pipeline's checkpoint differs from the one-process run's";
  // The controller moved the biases (the comparison above covers them).
  bool moved = false;
  for (const auto& [tensor, values] : ref)
    if (tensor.find("bias") != std::string::npos)
      for (const float v : values) moved |= v != 0.0f;
  EXPECT_TRUE(moved) << "no router bias moved";
}

// dist.offload = host_file in a pipeline of every process (dist.pp = 2 or 4, 1f1b; ZeRO-1, as
// offload runs): each process streams its stage's optimizer state through its own file, which
// computes what the state in memory computes, so the parameters and the checkpoint are those of
// the same pipeline without offload, bit for bit; no state file is left after the run; stopped
// after step 4 and resumed from that checkpoint, the run ends bitwise where the straight one ends.
TEST(PipelineSettings, OffloadInStagesIsBitwiseTheStateInMemoryAndResumes) {
  auto world = dist_world("pipeline_offload");
  const int W = world->size(), r = world->rank();
  SharedDir dir(*world, "pipeline_offload");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  auto config = [&](const std::string& name, bool offload) {
    return pipeline_config(dir / "data", dir / name, W, "1f1b", 1,
                           {"dist.zero=1", std::string("dist.offload=") +
                                               (offload ? "host_file" : "none")});
  };
  auto run = [&](const std::string& name, bool offload, int64_t stop_at = -1,
                 bool resume = false) {
    Trainer t(config(name, offload), resume, dist_world("pipeline_offload_run"));
    if (offload) {
      EXPECT_NE(t.optimizer().offload_store(), nullptr);
      EXPECT_TRUE(
          fs::exists(dir / name / "offload" / ("optim-rank" + std::to_string(t.rank()) + ".bin")));
    }
    t.run(stop_at);
    return finish_pipeline_run(t, dir / name);
  };
  const PipeOutcome mem = run("mem", false);
  const PipeOutcome off = run("off", true);
  EXPECT_EQ(differ_held(off.params, mem.params, off.held), 0)
      << "stage " << off.stage << ": offload differs from the state in memory";
  world->barrier();
  EXPECT_TRUE(fs::is_empty(dir / "off/offload")) << "state files left after the run";
  if (r == 0) {
    const std::string step = "checkpoints/step_00000006";
    EXPECT_TRUE(read_all_tensors(dir / "off" / step) == read_all_tensors(dir / "mem" / step))
        << "the offloaded pipeline's checkpoint differs from the one in memory";
  }
  run("stopped", true, 4);
  if (r == 0) copy_checkpoint(dir.path(), "stopped", "resumed", 3);
  world->barrier();
  const PipeOutcome resumed = run("resumed", true, -1, true);
  EXPECT_EQ(differ_held(resumed.params, mem.params, resumed.held), 0)
      << "the offloaded pipeline resumed at step 3 differs from the straight run";
}
