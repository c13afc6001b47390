// Test support for the pipeline tests (tests/parallel/pipeline_*_test.cpp): the small MoE LM they
// train with and without stages, which values a stage holds, and what a run leaves to compare.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "io/trace_events.h"
#include "parallel/pipeline_schedule.h"
#include "support/held_values.h"
#include "support/run_metrics.h"
#include "train/pipeline_step.h"
#include "train/run_config.h"
#include "train/trainer.h"

namespace moetrain::testing {

inline constexpr int64_t kPipeSteps = 6, kPipeAccum = 4;

// 4 blocks (MoE in three, with a shared expert: dense_every 3), 4 experts top-2, kPipeAccum
// micro-batches of 2 rows a step, validation and checkpoints at steps 3 and 6, f32, clip off.
// pp = 1: the run without stages; vp > 1 with the interleaved schedule.
inline RunConfig pipeline_config(const std::filesystem::path& data,
                                 const std::filesystem::path& run, int64_t pp,
                                 const std::string& schedule, int64_t vp = 1,
                                 const std::vector<std::string>& extra = {}) {
  std::vector<std::string> keys = {"model.dim=32",
                                   "model.n_layers=4",
                                   "model.n_heads=4",
                                   "model.n_kv_heads=2",
                                   "model.expert_hidden=24",
                                   "model.n_experts=4",
                                   "model.top_k=2",
                                   "model.shared_expert_hidden=16",
                                   "model.dense_every=3",
                                   "model.max_seq_len=16",
                                   "train.batch_size=2",
                                   "train.seq_len=16",
                                   "train.steps=" + std::to_string(kPipeSteps),
                                   "train.grad_accum=" + std::to_string(kPipeAccum),
                                   "train.eval_every=3",
                                   "train.eval_batches=2",
                                   "train.checkpoint_every=3",
                                   "train.keep_checkpoints=3",
                                   "train.progress=off",
                                   "train.precision=f32",
                                   "optim.warmup_steps=2",
                                   "optim.grad_clip=0",
                                   "data.dir=" + data.string(),
                                   "train.run_dir=" + run.string(),
                                   "dist.pp=" + std::to_string(pp),
                                   "dist.pp_schedule=" + schedule};
  if (vp > 1) keys.push_back("dist.vp=" + std::to_string(vp));
  keys.insert(keys.end(), extra.begin(), extra.end());
  return load_run_config("", keys);
}

// 1 for the values of the trainer's pipeline stage (its chunks' ranges); every value without
// stages.
inline std::vector<char> stage_values(Trainer& t) {
  std::vector<char> held(t.params().size(), 0);
  const PipelineRunner* pipe = t.pipeline();
  const std::vector<FlatRange> mine =
      pipe ? pipe_stage_params(t.model(), pipe->stages(), pipe->chunks_per_stage(), pipe->stage())
           : std::vector<FlatRange>{{0, static_cast<int64_t>(held.size())}};
  for (const FlatRange& r : mine) std::fill_n(held.begin() + r.offset, r.size, 1);
  return held;
}

struct PipeOutcome {
  std::vector<float> params;
  std::vector<char> held;  // the values of this rank's stage
  std::vector<double> losses, val_losses, grad_norms;  // rank 0's metrics
  int64_t slots = 0, stage = 0, stages = 1;  // activation slots the stage made
};

inline PipeOutcome finish_pipeline_run(Trainer& t, const std::filesystem::path& run) {
  PipeOutcome o;
  o.params.assign(t.params().begin(), t.params().end());
  o.held = stage_values(t);
  if (const PipelineRunner* pipe = t.pipeline())
    o.slots = pipe->slots_made(), o.stage = pipe->stage(), o.stages = pipe->stages();
  if (t.rank() == 0) {
    o.losses = metric(run, "loss"), o.val_losses = metric(run, "val_loss");
    o.grad_norms = metric(run, "grad_norm");
  }
  return o;
}

// A pipeline run against the one-process run, where the code path makes them the same bits: the
// values the rank's stage holds exactly; on rank 0 the losses and gradient norms within 1e-12
// (their parts are summed per stage, then over the stages), the validation losses exactly.
inline void expect_pipe_follows_single(const PipeOutcome& got, const PipeOutcome& ref, int rank) {
  EXPECT_EQ(differ_held(got.params, ref.params, got.held), 0)
      << "stage parameters differ from the one-process run's";
  if (rank != 0) return;
  ASSERT_EQ(got.losses.size(), static_cast<std::size_t>(kPipeSteps));
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  EXPECT_LE(max_rel(got.losses, ref.losses), 1e-12);
  EXPECT_LT(got.losses.back(), got.losses.front());
  ASSERT_EQ(ref.grad_norms.size(), got.grad_norms.size());
  EXPECT_LE(max_rel(got.grad_norms, ref.grad_norms), 1e-12);
  ASSERT_EQ(got.val_losses.size(), 2u);
  EXPECT_EQ(got.val_losses, ref.val_losses);
}

// The last step as it ran (RUN_DIR/pipeline_trace.json) against the schedule: each stage's passes
// on a lane of its own, in stage_ops' order, one at a time, named F/B/W and the micro-batch (and
// ".c" and the chunk where a stage holds several). *weight_passes (if given): the weight passes
// the trace files under the "weight" category.
inline void expect_trace_follows_schedule(const std::filesystem::path& trace_file,
                                          PipeSchedule schedule, const PipeShape& shape,
                                          int64_t* weight_passes = nullptr) {
  const TraceFile trace = read_trace(trace_file);
  for (int64_t stage = 0; stage < shape.stages; ++stage) {
    std::vector<TraceSpan> lane;
    for (const TraceSpan& span : trace.spans)
      if (span.lane == stage) lane.push_back(span);
    const std::vector<PipeOp> ops = stage_ops(schedule, shape, stage);
    ASSERT_EQ(lane.size(), ops.size()) << "stage " << stage;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      std::string name = std::string(1, "FBW"[ops[i].kind]) + std::to_string(ops[i].micro);
      if (shape.virtual_stages > 1) name += ".c" + std::to_string(ops[i].chunk);
      EXPECT_EQ(lane[i].name, name) << "stage " << stage << " pass " << i;
      if (weight_passes)
        *weight_passes += ops[i].kind == PipeOp::Weight && lane[i].category == "weight";
      if (i > 0) {
        EXPECT_GE(lane[i].start_s, lane[i - 1].start_s + lane[i - 1].duration_s);
      }
    }
  }
}

}  // namespace moetrain::testing
