// Settings the one-process and data-parallel trainers run, in pipeline stages (dist.pp = 2 on 2
// processes as one pipeline, on 4 as two), each against the same layout without the setting:
// activation recomputation in every activation slot.
//
// Bitwise where the code path is the same: recomputation computes each block's activations
// again with the same operations on the same inputs (Transformer::set_recompute: the gradients
// are the same bits in every mode), in each slot's own model, so the stages' gradients, the
// parameters, the losses and the checkpointed tensors have the bits of the run that keeps every
// activation.
#include <gtest/gtest.h>

#include <filesystem>
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
};

StageRun run_pipe(const fs::path& data, const fs::path& run, const std::string& schedule, int64_t vp,
             const std::vector<std::string>& extra, bool resume = false) {
  Trainer t(pipeline_config(data, run, 2, schedule, vp, extra), resume,
            dist_world("pipeline_settings_run"));
  t.run();
  StageRun out;
  out.outcome = finish_pipeline_run(t, run);
  out.recompute = t.model().recompute();
  return out;
}

}  // namespace

// train.recompute = moe and full in the stages of 1f1b, of interleaved (2 chunks a stage) and
// (moe only: full keeps one set of block activations, which the deferred weight passes would
// read overwritten) of zero_bubble, against recompute = none under the same schedule.
TEST(PipelineSettings, RecomputeInStagesEndsWhereKeepingEveryActivationEndsBitwise) {
  auto world = dist_world("pipeline_recompute");
  const int r = world->rank();
  SharedDir dir(*world, "pipeline_recompute");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  struct Case {
    std::string schedule;
    int64_t vp;
    std::vector<std::string> modes;
  };
  for (const Case& c : {Case{"1f1b", 1, {"moe", "full"}}, Case{"interleaved", 2, {"moe", "full"}},
                        Case{"zero_bubble", 1, {"moe"}}}) {
    SCOPED_TRACE(c.schedule);
    const fs::path kept_run = dir / (c.schedule + "_none");
    const StageRun kept = run_pipe(dir / "data", kept_run, c.schedule, c.vp, {"train.recompute=none"});
    for (const std::string& mode : c.modes) {
      SCOPED_TRACE(mode);
      const fs::path run = dir / (c.schedule + "_" + mode);
      const StageRun got = run_pipe(dir / "data", run, c.schedule, c.vp, {"train.recompute=" + mode});
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
