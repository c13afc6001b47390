// Pipeline stages of tensor-parallel groups (dist.pp = 2 × dist.tp = 2 on 4 processes: ranks
// (stage · 2 + t)) against the one-process run with the same global batch and seed, under 1f1b
// (with the reduction and the last sends on the communication thread, dist.overlap, and without),
// gpipe, zero_bubble (split backward: the deferred weight GEMMs of the ranks' slices) and
// interleaved (dist.vp = 2: two chunks a stage, each slot's model a tensor-parallel one), and
// under 1f1b with ZeRO-1, ZeRO-2 and dist.offload = host_file; with the experts sharded over a
// stage's two TP ranks (dist.ep = 2, 1f1b and interleaved: each rank routes its half of the
// stage's tokens to the rank holding their experts); with sequence parallelism (1f1b,
// interleaved, and 1f1b with dist.ep = 2: a stage boundary carries each rank's half of the
// stream's rows); fp16 against the one-process fp16 run.
//
// Not bitwise, for the reasons the tensor-parallel test gives (tensor_parallel_test.cpp): the
// attention's output projection, a dense FFN's down projection and the LM head's input gradient
// are sums over the two ranks' heads, hidden units and vocabulary columns, and the cross-entropy's
// exponentials are summed per vocabulary half, each a reordering of a float sum of ≤ 32 terms
// (relative error ≤ K·ε = 4e-6 a product). Over 6 AdamW steps (whose updates are ~lr whatever the
// gradient's last bits) its bounds hold: losses 1e-5, gradient norms 1e-4, parameters 1e-4 of the
// largest (measured: about 1e-9, 3e-8 and 7e-6). With dist.ep = 2 an expert's weight gradient
// sums the rows of both ranks' tokens in the exchange's order, one more reordered float sum, so
// the same bounds hold (tensor_parallel_test.cpp's EP case argues them); so do they under
// sequence parallelism, whose reduce-scatter sums the all-reduce's terms and whose norm and
// embedding gradients are sums of the two ranks' token halves. Bitwise where the code
// path is the same: the checkpoint holds every rank's values, one process resuming from it starts
// from them, and a run resumed in its own layout ends on the uninterrupted run's bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "parallel/pipeline_runs.h"  // tests/parallel/pipeline_runs.h
#include "parallel/runtime.h"
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

constexpr int64_t kStages = 2, kTp = 2;

// The run's values this rank holds: its stage's, less the experts other ranks hold (dist.ep).
std::vector<char> held(Trainer& t) {
  std::vector<char> h = stage_values(t), owned = held_values(t);
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = h[i] && owned[i];
  return h;
}

PipeOutcome run(const RunConfig& cfg, std::unique_ptr<Comm> world, bool resume = false) {
  Trainer t(cfg, resume, std::move(world));
  t.run();
  PipeOutcome o = finish_pipeline_run(t, cfg.train.run_dir);
  o.held = held(t);
  return o;
}

// The largest difference of a held value from the reference, relative to the largest held
// reference value.
double max_param_diff(const PipeOutcome& got, const std::vector<float>& ref) {
  return max_rel_diff_held(got.params, ref, got.held);
}

// Each step's skip flag (a JSON boolean; fp16 runs only).
std::vector<bool> skip_flags(const fs::path& run_dir) {
  std::vector<bool> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("skipped")) out.push_back(j["skipped"].get<bool>());
  }
  return out;
}

}  // namespace

TEST(PipelineTensorParallel, StagesOfTensorParallelGroupsFollowTheOneProcessRun) {
  auto world = dist_world("pipeline_tp");
  const int W = world->size(), r = world->rank();
  if (W != kStages * kTp)
    GTEST_SKIP() << "dist.pp = 2 × dist.tp = 2 runs on 4 processes; this run has " << W;
  SharedDir dir(*world, "pipeline_tp");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  // One pipeline: its global batch is kPipeAccum micro-batches of 2 rows, the one process's.
  const fs::path single_dir = dir / ("single" + std::to_string(r));
  const PipeOutcome single =
      run(pipeline_config(dir / "data", single_dir, 1, "1f1b"), make_local_comm());
  struct Variant {
    std::string name, schedule;
    std::vector<std::string> keys;
  };
  const std::vector<Variant> variants = {
      {"1f1b_true", "1f1b", {"dist.overlap=true"}},
      {"1f1b_false", "1f1b", {"dist.overlap=false"}},
      {"gpipe", "gpipe", {"dist.overlap=true"}},
      {"zero_bubble", "zero_bubble", {"dist.overlap=true"}},
      {"interleaved", "interleaved", {"dist.overlap=true", "dist.vp=2"}},
      {"1f1b_zero1", "1f1b", {"dist.zero=1"}},  // ZeRO-1 over the stage's copies
      // ZeRO-2: each rank reduce-scatters the gradients its tensor-parallel slices wrote over
      // the stage's copies (every TP rank of the stage), and the shards' norms sum over the world.
      {"1f1b_zero2", "1f1b", {"dist.zero=2"}},
      // Each rank streams its shard of the stage's optimizer state through its own file.
      {"1f1b_host_file", "1f1b", {"dist.offload=host_file", "dist.zero=1"}},
      // Experts sharded over the stage's copies (both TP ranks of the stage: one EP group of
      // two, no EDP reduction of expert gradients), each rank routing its half of the tokens.
      {"1f1b_ep2", "1f1b", {"dist.ep=2"}},
      {"interleaved_ep2", "interleaved", {"dist.ep=2", "dist.vp=2"}},
      // Sequence parallelism: each boundary carries rank t's half of the stream's rows to rank
      // t of the next stage (interleaved: three boundaries a micro-batch), the first stage embeds
      // its tokens, the last gathers the final norm's rows for the head; with the experts
      // sharded, each rank's MoE tokens are its rows.
      {"1f1b_sp", "1f1b", {"dist.sequence_parallel=true"}},
      {"interleaved_sp", "interleaved", {"dist.sequence_parallel=true", "dist.vp=2"}},
      {"1f1b_sp_ep2", "1f1b", {"dist.sequence_parallel=true", "dist.ep=2"}}};
  PipeOutcome overlapped, experts;
  for (const auto& [name, schedule, keys] : variants) {
    SCOPED_TRACE(name);
    std::vector<std::string> extra = keys;
    extra.push_back("dist.tp=" + std::to_string(kTp));
    const fs::path run_dir = dir / name;
    const PipeOutcome got =
        run(pipeline_config(dir / "data", run_dir, kStages, schedule, 1, extra),
            dist_world("pipeline_tp_run"));
    // Ranks (stage · tp + t): the stage is the rank's pair.
    EXPECT_EQ(got.stage, r / kTp);
    if (schedule == "1f1b") {
      EXPECT_EQ(got.slots, kStages - got.stage);
    }
    if (schedule == "gpipe") {
      EXPECT_EQ(got.slots, kPipeAccum);
    }
    EXPECT_LE(max_param_diff(got, single.params), 1e-4);
    if (r == 0) {
      ASSERT_EQ(got.losses.size(), static_cast<std::size_t>(kPipeSteps));
      ASSERT_EQ(single.losses.size(), got.losses.size());
      EXPECT_LE(max_rel(got.losses, single.losses), 1e-5);
      EXPECT_LT(got.losses.back(), got.losses.front());
      ASSERT_EQ(single.grad_norms.size(), got.grad_norms.size());
      EXPECT_LE(max_rel(got.grad_norms, single.grad_norms), 1e-4);
      ASSERT_EQ(got.val_losses.size(), 2u);
      ASSERT_EQ(single.val_losses.size(), got.val_losses.size());
      EXPECT_LE(max_rel(got.val_losses, single.val_losses), 1e-5);
    }
    // The overlap only moves the same sums of two ranks' values onto the communication thread.
    if (name == "1f1b_true") overlapped = got;
    if (name == "1f1b_ep2") experts = got;
    if (name == "1f1b_false") {
      EXPECT_EQ(differ_held(got.params, overlapped.params, got.held), 0)
          << "1f1b with overlap differs from 1f1b without it";
    }
    // The stages' checkpoint holds the whole model: every rank finds its values there, bit for
    // bit.
    const LoadedModel m = load_model(run_dir);
    EXPECT_EQ(m.step, kPipeSteps);
    ASSERT_EQ(m.params.size(), got.params.size());
    EXPECT_EQ(differ_held(m.params, got.params, got.held), 0)
        << "checkpointed parameters differ from their holder's";
  }
  // The experts' run resumed from its step-3 checkpoint in its own layout: each rank reloads its
  // stage's tensors, its experts' optimizer moments and the data position, and ends on the
  // uninterrupted run's bits (the same passes in the same order from the same values).
  if (r == 0) {
    fs::create_directories(dir / "resumed_ep2/checkpoints");
    fs::copy(dir / "1f1b_ep2/checkpoints/step_00000003",
             dir / "resumed_ep2/checkpoints/step_00000003");
    std::ofstream(dir / "resumed_ep2/checkpoints/latest") << "step_00000003";
    fs::copy_file(dir / "1f1b_ep2/metrics.jsonl", dir / "resumed_ep2/metrics.jsonl");
  }
  world->barrier();
  {
    const PipeOutcome resumed =
        run(pipeline_config(dir / "data", dir / "resumed_ep2", kStages, "1f1b", 1,
                            {"dist.ep=2", "dist.tp=" + std::to_string(kTp)}),
            dist_world("pipeline_tp_resume"), true);
    EXPECT_EQ(differ_held(resumed.params, experts.params, resumed.held), 0)
        << "pp × tp × ep resumed at step 3 differs from the uninterrupted run";
  }
  // The pipelines' step-3 checkpoints (plain, experts sharded, and with sequence parallelism
  // too) resumed by one process
  // (the same global batch): it starts from the checkpoint's parameters, bit for bit, and runs on.
  for (const std::string from : {"1f1b_true", "1f1b_ep2", "1f1b_sp_ep2"}) {
    SCOPED_TRACE(from);
    TempDir back("pipeline_tp_back");
    fs::create_directories(back.path() / "checkpoints");
    fs::copy(dir / (from + "/checkpoints/step_00000003"),
             back.path() / "checkpoints/step_00000003");
    std::ofstream(back.path() / "checkpoints/latest") << "step_00000003";
    fs::copy_file(dir / (from + "/metrics.jsonl"), back.path() / "metrics.jsonl");
    Trainer one(pipeline_config(dir / "data", back.path(), 1, "1f1b"), true, make_local_comm());
    EXPECT_EQ(one.step(), 3);
    const LoadedModel at3 = load_model(dir / (from + "/checkpoints/step_00000003"));
    ASSERT_EQ(at3.params.size(), one.params().size());
    EXPECT_EQ(0, std::memcmp(one.params().data(), at3.params.data(),
                             at3.params.size() * sizeof(float)));
    one.run();
    EXPECT_EQ(one.step(), kPipeSteps);
  }
}

// train.precision = fp16 in stages of tensor-parallel groups (1f1b, and ZeRO-2, where each rank
// checks only its shard of the stage's gradients) against the one-process fp16 run. A first scale
// of 2^22 overflows the fp16 GEMM operands in some steps (3 of 6), not in all: the scaler skips
// steps, and the stages do not overflow together, so that only the overflow flag summed over the
// world (every stage and every tensor-parallel rank) makes every rank skip the steps the one
// process skips, with the same scales (without it the ranks skip apart and their collectives no
// longer match). The bounds are fp16's (tensor_parallel_settings_test.cpp
// argues them): a reordered f32 sum across an fp16 rounding boundary moves a GEMM operand by one
// fp16 unit, 2^-11 relative, so gradient norms agree within 2^-11 and parameters within 4·2^-11
// of the largest; the losses, f32 means of log-softmaxes, within 1e-5.
TEST(PipelineTensorParallel, FloatSixteenInStagesSkipsWithTheOneProcessRun) {
  auto world = dist_world("pipeline_tp_fp16");
  const int W = world->size(), r = world->rank();
  if (W != kStages * kTp)
    GTEST_SKIP() << "dist.pp = 2 × dist.tp = 2 runs on 4 processes; this run has " << W;
  SharedDir dir(*world, "pipeline_tp_fp16");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const std::vector<std::string> fp16 = {"train.precision=fp16", "train.loss_scale_init=4194304",
                                         "train.loss_scale_growth_interval=2"};
  const fs::path single_dir = dir / ("single" + std::to_string(r));
  const PipeOutcome single =
      run(pipeline_config(dir / "data", single_dir, 1, "1f1b", 1, fp16), make_local_comm());
  for (const std::string zero : {"dist.zero=0", "dist.zero=2"}) {
    SCOPED_TRACE(zero);
    std::vector<std::string> keys = fp16;
    keys.push_back(zero);
    keys.push_back("dist.tp=" + std::to_string(kTp));
    const fs::path run_dir = dir / ("fp16_" + zero.substr(zero.find('=') + 1));
    const PipeOutcome got = run(pipeline_config(dir / "data", run_dir, kStages, "1f1b", 1, keys),
                                dist_world("pipeline_tp_fp16_run"));
    EXPECT_EQ(got.stage, r / kTp);
    EXPECT_LE(max_param_diff(got, single.params), 4 * 0x1p-11);
    if (r != 0) continue;
    const std::vector<bool> skipped = skip_flags(run_dir), ref = skip_flags(single_dir);
    ASSERT_EQ(ref.size(), static_cast<std::size_t>(kPipeSteps));
    EXPECT_GT(std::count(ref.begin(), ref.end(), true), 0) << "no step overflowed";
    EXPECT_LT(std::count(ref.begin(), ref.end(), true), kPipeSteps) << "every step overflowed";
    EXPECT_EQ(skipped, ref);
    EXPECT_EQ(metric(run_dir, "loss_scale"), metric(single_dir, "loss_scale"));
    ASSERT_EQ(got.losses.size(), single.losses.size());
    EXPECT_LE(max_rel(got.losses, single.losses), 1e-5);
    ASSERT_EQ(got.grad_norms.size(), single.grad_norms.size());
    EXPECT_LE(max_rel(got.grad_norms, single.grad_norms), 0x1p-11);
  }
}
