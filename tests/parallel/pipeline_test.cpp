// Pipeline parallelism (dist.pp = the number of processes, one stage each) against the
// one-process run with the same global batch and seed, under the gpipe, 1f1b and zero_bubble
// schedules, and zero_bubble with 2 chunks a stage against interleaved.
//
// Bitwise where the code path is the same: each stage runs its blocks' forward and backward as
// the whole model does (Transformer::set_stage), its parameter gradients accumulate over the
// micro-batches in the same order, and AdamW is elementwise, so with the clip off the parameters,
// the checkpointed tensors and the validation losses (the last stage's cross-entropy, summed
// with zeros) have the one-process bits. zero_bubble's weight passes run the deferred weight
// GEMMs in micro-batch order (Transformer::set_split_backward), so it ends where 1f1b ends, bit
// for bit, its training losses too (the same forwards, summed in the same order). Not bitwise: the training loss and the gradient norm,
// whose parts are summed per stage and then over the stages (the balancing losses' and the
// squares' sums regrouped); double sums of a few hundred terms, so 1e-12 relative bounds them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "parallel/runtime.h"
#include "io/trace_events.h"
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

RunConfig make_config(const fs::path& data, const fs::path& run, int64_t pp,
                      const std::string& schedule, std::vector<std::string> extra = {}) {
  return pipeline_config(data, run, pp, schedule, 1, extra);
}

Outcome finish(Trainer& t, const fs::path& run) { return finish_pipeline_run(t, run); }

// The one-process run, on every rank (each its own).
Outcome run_single(const fs::path& data, const fs::path& run) {
  Trainer t(make_config(data, run, 1, "1f1b"), false, make_local_comm());
  t.run();
  return finish(t, run);
}

Outcome run_pipeline(const fs::path& data, const fs::path& run, const std::string& schedule,
                     bool resume = false) {
  const int W = dist_world("pp_size")->size();
  Trainer t(make_config(data, run, W, schedule), resume, dist_world("pipeline_test"));
  t.run();
  return finish(t, run);
}

}  // namespace

TEST(Pipeline, GPipeAndOneFOneBFollowTheOneProcessRunBitwise) {
  auto world = dist_world("pipeline");
  const int r = world->rank();
  SharedDir dir(*world, "pipeline");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const std::string single_dir = "single" + std::to_string(r);
  const Outcome single = run_single(dir / "data", dir / single_dir);
  Outcome one_f_one_b;
  for (const std::string schedule : {"gpipe", "1f1b", "zero_bubble"}) {
    SCOPED_TRACE(schedule);
    const Outcome piped = run_pipeline(dir / "data", dir / schedule, schedule);
    expect_pipe_follows_single(piped, single, r);
    // gpipe holds every micro-batch's activations; 1f1b at most P − s on stage s; zero_bubble
    // P on every stage (stage s runs its weight passes s micro-batches late).
    EXPECT_EQ(piped.slots, schedule == "gpipe"  ? kAccum
                           : schedule == "1f1b" ? piped.stages - piped.stage
                                                : piped.stages);
    if (schedule == "1f1b") one_f_one_b = piped;
    if (schedule == "zero_bubble") {
      EXPECT_EQ(piped.params, one_f_one_b.params) << "zero_bubble ends where 1f1b ends";
      EXPECT_EQ(piped.losses, one_f_one_b.losses);
      EXPECT_EQ(piped.grad_norms, one_f_one_b.grad_norms);
    }
    // The last step as it ran (RUN_DIR/pipeline_trace.json): each stage's passes in its
    // schedule's order, one at a time, on a lane of its own.
    if (r == 0) {
      expect_trace_follows_schedule(dir / schedule / kPipelineTraceFile,
                                    parse_pipe_schedule(schedule, "schedule"),
                                    {piped.stages, kAccum, 1});
    }
    // The stages' checkpoint holds the one-process checkpoint's tensors, bit for bit: the
    // parameters and the optimizer moments, each written by the stage that holds it.
    if (r == 0) {
      const std::string step = "checkpoints/step_00000006";
      const auto mine = read_all_tensors(dir / (schedule + "/" + step));
      const auto one = read_all_tensors(dir / (single_dir + "/" + step));
      EXPECT_GT(mine.size(), 10u);
      EXPECT_TRUE(mine == one) << "the pipeline's checkpoint differs from the one-process run's";
    }
  }
  // The one-process run's step-3 checkpoint resumed by the pipeline: the one-process bits.
  if (r == 0) {
    fs::create_directories(dir / "resumed/checkpoints");
    fs::copy(dir / "single0/checkpoints/step_00000003", dir / "resumed/checkpoints/step_00000003");
    std::ofstream(dir / "resumed/checkpoints/latest") << "step_00000003";
    fs::copy_file(dir / "single0/metrics.jsonl", dir / "resumed/metrics.jsonl");
  }
  world->barrier();
  for (const std::string schedule : {"1f1b", "zero_bubble"}) {
    SCOPED_TRACE(schedule);
    const fs::path run = dir / ("resumed_" + schedule);
    if (r == 0) fs::copy(dir / "resumed", run, fs::copy_options::recursive);
    world->barrier();
    const Outcome resumed = run_pipeline(dir / "data", run, schedule, true);
    EXPECT_EQ(differ_held(resumed.params, single.params, resumed.held), 0)
        << "the pipeline resumed from a one-process checkpoint differs";
  }
  // And the pipeline's step-3 checkpoint resumed by one process.
  TempDir back("pipeline_back");
  fs::create_directories(back.path() / "checkpoints");
  fs::copy(dir / "gpipe/checkpoints/step_00000003", back.path() / "checkpoints/step_00000003");
  std::ofstream(back.path() / "checkpoints/latest") << "step_00000003";
  fs::copy_file(dir / "gpipe/metrics.jsonl", back.path() / "metrics.jsonl");
  Trainer t(make_config(dir / "data", back.path(), 1, "1f1b"), true, make_local_comm());
  t.run();
  EXPECT_EQ(0, std::memcmp(t.params().data(), single.params.data(),
                           single.params.size() * sizeof(float)))
      << "one process resumed from the pipeline's checkpoint differs";
}

// Router-bias balancing, the dynamic capacity controller and expert reweighting under a pipeline
// of every process (an expert's gradient sums come from the one stage holding it, the others add
// zeros; the loads are integer counts):
// each stage routes its layers, the bias update sums every activation slot's routing counts over
// the processes (other stages' layers add zeros), and every rank runs every layer's capacity
// controller on the step's figures summed over the world, so each step's biases and factors are
// those of the one-process run (integer counts, the same controller on the same sums), and so
// are the parameters, the checkpoint (the biases in it) and the logged factors, bit for bit.
TEST(Pipeline, BalancingAndReweightingFollowTheOneProcessRunBitwise) {
  auto world = dist_world("pipeline_balance");
  const int W = world->size(), r = world->rank();
  SharedDir dir(*world, "pipeline_balance");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const std::vector<std::pair<std::string, std::vector<std::string>>> features = {
      {"bias", {"model.router=sigmoid_bias"}},
      {"capacity", {"model.capacity_factor=1.0", "model.capacity=dynamic"}},
      {"importance", {"grad.expert_reweight=importance"}},
      {"utilisation", {"grad.expert_reweight=utilisation"}}};
  for (const auto& [name, keys] : features) {
    SCOPED_TRACE(name);
    const fs::path single_run = dir / (name + "_single" + std::to_string(r));
    Trainer one(make_config(dir / "data", single_run, 1, "1f1b", keys), false, make_local_comm());
    one.run();
    const Outcome single = finish(one, single_run);
    const fs::path run = dir / (name + "_pp");
    Trainer t(make_config(dir / "data", run, W, "1f1b", keys), false,
              dist_world("pipeline_balance_run"));
    t.run();
    const Outcome piped = finish(t, run);
    EXPECT_EQ(differ_held(piped.params, single.params, piped.held), 0)
        << "stage parameters differ from the one-process run's";
    if (r != 0) continue;
    EXPECT_LE(max_rel(piped.losses, single.losses), 1e-12);
    const std::string step = "checkpoints/step_00000006";
    const auto mine = read_all_tensors(run / step);
    const auto ref = read_all_tensors(single_run / step);
    EXPECT_TRUE(mine == ref) << "the pipeline's checkpoint differs from the one-process run's";
    if (name == "bias") {
      std::size_t biases = 0;
      for (const auto& [tensor, values] : ref)
        biases += tensor.find("bias") != std::string::npos ? 1 : 0;
      EXPECT_GT(biases, 0u) << "the checkpoint holds no router bias";
      continue;
    }
    // A per-layer figure of each step's metrics line.
    auto series = [](const fs::path& dir_, const char* key) {
      std::vector<std::vector<double>> out;
      std::ifstream in(dir_ / "metrics.jsonl");
      for (std::string line; std::getline(in, line);) {
        const auto j = nlohmann::json::parse(line);
        if (j.contains(key)) out.push_back(j[key]);
      }
      return out;
    };
    if (name != "capacity") {
      // The factors in effect, every layer's smallest and largest, step by step: not all ones.
      const auto hi = series(run, "expert_reweight_max");
      EXPECT_EQ(series(run, "expert_reweight_min"), series(single_run, "expert_reweight_min"));
      EXPECT_EQ(hi, series(single_run, "expert_reweight_max"));
      ASSERT_EQ(hi.size(), static_cast<std::size_t>(kSteps));
      EXPECT_GT(*std::max_element(hi.back().begin(), hi.back().end()), 1.0)
          << "no expert was reweighted";
      continue;
    }
    // Every layer's factor, each stage's included, step by step; the controller moved them.
    const auto got = series(run, "capacity_factor"), want = series(single_run, "capacity_factor");
    ASSERT_EQ(got.size(), static_cast<std::size_t>(kSteps));
    EXPECT_EQ(got, want);
    EXPECT_NE(want.front(), want.back()) << "the controller never moved a factor";
  }
}

// Four processes as two pipelines of two stages: each stage's two copies reduce their gradients
// as data parallelism does, which sums them in another order than the one-process backward sums
// the rows (as tests/parallel/train_test.cpp's data-parallel runs): float rounding of the
// gradient, amplified over 6 AdamW steps, within the bounds that test uses.
TEST(Pipeline, TwoPipelinesOfTwoStagesFollowTheOneProcessRun) {
  auto world = dist_world("pipeline_dp");
  const int W = world->size(), r = world->rank();
  if (W != 4) GTEST_SKIP() << "needs 4 processes for 2 pipelines x 2 stages";
  SharedDir dir(*world, "pipeline_dp");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  Outcome single;
  {
    const fs::path run = dir / ("single" + std::to_string(r));
    Trainer t(make_config(dir / "data", run, 1, "1f1b", {"train.batch_size=4"}), false,
              make_local_comm());
    t.run();
    single = finish(t, run);
  }
  const fs::path run = dir / "dp";
  Trainer t(make_config(dir / "data", run, 2, "1f1b", {"dist.overlap=false"}), false,
            dist_world("pipeline_dp_run"));
  t.run();
  const Outcome got = finish(t, run);
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
  // ZeRO-1 shards each stage's optimizer state over its two copies (the experts' too: each
  // expert is on both): every element is stepped by one copy with the same elementwise update
  // on the same reduced gradient (a sum of two terms, one order), then gathered, so the
  // parameters and the checkpoint are those of the run above, bit for bit.
  const fs::path zrun = dir / "dp_zero1";
  Trainer z(make_config(dir / "data", zrun, 2, "1f1b", {"dist.overlap=false", "dist.zero=1"}),
            false, dist_world("pipeline_dp_zero1"));
  z.run();
  const Outcome sharded = finish(z, zrun);
  int64_t stepped = 0;
  for (const OptimPiece& p : z.optimizer().pieces()) stepped += p.size;
  const auto stage_size = std::count(sharded.held.begin(), sharded.held.end(), 1);
  EXPECT_LT(stepped, stage_size * 3 / 4) << "the copies do not share the stage's optimizer state";
  EXPECT_GT(stepped, stage_size / 4) << "the copies do not share the stage's optimizer state";
  EXPECT_EQ(differ_held(sharded.params, got.params, got.held), 0)
      << "ZeRO-1 stage parameters differ from the run without it";
  if (r == 0) {
    EXPECT_LE(max_rel(metric(zrun, "loss"), got.losses), 1e-12);
    const std::string step = "checkpoints/step_00000006";
    EXPECT_TRUE(read_all_tensors(zrun / step) == read_all_tensors(run / step))
        << "the ZeRO-1 pipelines' checkpoint differs from the pipelines' without it";
  }
}

TEST(Pipeline, RefusesAStageCountThatDoesNotFitTheProcesses) {
  auto world = dist_world("pipeline_refuse");
  const int W = world->size();
  SharedDir dir(*world, "pipeline_refuse");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  // W + 1 stages (the model has 4 blocks; W ≤ 3 leaves that within them) or, on 4 processes,
  // 3 stages.
  const int64_t pp = W < 4 ? W + 1 : 3;
  const fs::path run = dir / "refused";
  try {
    Trainer t(make_config(dir / "data", run, pp, "gpipe"), false, dist_world("refused"));
    ADD_FAILURE() << "dist.pp = " << pp << " on " << W << " processes was not refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dist.pp = " + std::to_string(pp)), std::string::npos)
        << e.what();
  }
  world->barrier();
  EXPECT_FALSE(fs::exists(run)) << "a refused run wrote " << run;
}

// Pipelines whose stages run expert parallelism (dist.pp = 2, dist.ep = 2 on 4 processes: each
// stage's two copies are one EP group) against the run without stages on 2 processes with
// dist.ep = 2, the same global batch and seed.
//
// Bitwise where the code path is the same: copy c of a stage reads what rank c reads without
// stages; its MoE layers route the same tokens over an EP group of the same two ranks (the
// balancing statistics reduced over the same two) and compute each expert's rows in the same
// order; each gradient accumulates over the micro-batches in micro-batch order on both, and the
// dense gradients sum over the two copies as over the two ranks (a sum of two terms, one order);
// expert gradients are not reduced (one EDP rank). AdamW is elementwise, so with the clip off the
// parameters, the moments and the checkpointed tensors have the bits of the run without stages.
// The training loss and the gradient norm are summed per stage, then over the stages (regrouped
// double sums of a few hundred terms: 1e-12 relative), as in the tests above.
TEST(Pipeline, ExpertParallelStagesFollowTheExpertParallelRunBitwise) {
  auto world = dist_world("pipeline_ep");
  const int W = world->size(), r = world->rank();
  if (W != 4) GTEST_SKIP() << "needs 4 processes for 2 pipelines x 2 stages, dist.ep = 2";
  SharedDir dir(*world, "pipeline_ep");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const std::vector<std::string> ep = {"dist.ep=2", "dist.overlap=false"};
  // The processes per machine are found once, collectively over every process: before a
  // trainer runs on half of them.
  dist_local_size();
  // The run without stages on ranks 0 and 1; each writes its parameters for the copies that
  // hold the same experts (copy c of each stage holds rank c's).
  auto half = world->split(r / 2, r % 2, {"half"});
  auto ref_file = [&](int c) { return dir / ("ref_params" + std::to_string(c) + ".bin"); };
  if (r < 2) {
    Trainer t(make_config(dir / "data", dir / "ep", 1, "1f1b", ep), false, half->dup("ep_run"));
    t.run();
    std::ofstream(ref_file(r), std::ios::binary)
        .write(reinterpret_cast<const char*>(t.params().data()),
               static_cast<std::streamsize>(t.params().size() * sizeof(float)));
  }
  world->barrier();
  const std::vector<double> ref_losses = metric(dir / "ep", "loss");
  const std::vector<double> ref_norms = metric(dir / "ep", "grad_norm");
  const std::vector<double> ref_val = metric(dir / "ep", "val_loss");
  // ZeRO-1 shards the stage's optimizer state over its copies: each element is stepped by one
  // of them with the same elementwise update, the reduced gradient the same two-term sum.
  // Overlap (dist.overlap, the default) reduces the same buckets with the same calls on the
  // communication thread during the last backward, and the exchanges and the pipe's last sends
  // go through that thread: the same sums, so the same bits.
  // zero_bubble with overlap: the grads-ready hook runs from the weight passes, the buckets are
  // reduced while the stage's last weight pass runs; with 2 chunks a stage (dist.vp = 2) the
  // same on the interleaved order, whose chunks' B and W passes each run in micro-batch order.
  for (const std::string variant : {"gpipe", "1f1b", "1f1b_zero1", "1f1b_overlap",
                                    "zero_bubble_overlap", "zero_bubble_vp2_overlap"}) {
    SCOPED_TRACE(variant);
    const bool zero1 = variant == "1f1b_zero1";
    const bool zb = variant.starts_with("zero_bubble");
    const bool overlap = variant == "1f1b_overlap" || zb;
    const std::string schedule = zb ? "zero_bubble" : zero1 || overlap ? "1f1b" : variant;
    std::vector<std::string> keys = ep;
    if (zero1) keys.push_back("dist.zero=1");
    if (overlap) keys = {"dist.ep=2"};
    if (variant == "zero_bubble_vp2_overlap") keys.push_back("dist.vp=2");
    const fs::path run = dir / ("pp_ep_" + variant);
    Trainer t(make_config(dir / "data", run, 2, schedule, keys), false, dist_world("pp_ep_run"));
    t.run();
    const PipelineRunner* pipe = t.pipeline();
    ASSERT_NE(pipe, nullptr);
    EXPECT_EQ(pipe->chunks_per_stage(), variant == "zero_bubble_vp2_overlap" ? 2 : 1);
    // The values this rank holds: its experts, within its stage's chunks.
    std::vector<char> held = held_values(t);
    const std::vector<char> stage = stage_values(t);
    for (std::size_t i = 0; i < held.size(); ++i) held[i] &= stage[i];
    std::vector<float> ref(t.params().size());
    std::ifstream(ref_file(static_cast<int>(pipe->replica())), std::ios::binary)
        .read(reinterpret_cast<char*>(ref.data()),
              static_cast<std::streamsize>(ref.size() * sizeof(float)));
    const std::vector<float> got(t.params().begin(), t.params().end());
    EXPECT_EQ(differ_held(got, ref, held), 0)
        << "stage " << pipe->stage() << " copy " << pipe->replica()
        << ": parameters differ from the run without stages";
    if (r == 0) {
      const std::vector<double> losses = metric(run, "loss"), norms = metric(run, "grad_norm");
      ASSERT_EQ(losses.size(), static_cast<std::size_t>(kSteps));
      ASSERT_EQ(ref_losses.size(), losses.size());
      EXPECT_LE(max_rel(losses, ref_losses), 1e-12);
      EXPECT_LT(losses.back(), losses.front());
      ASSERT_EQ(norms.size(), ref_norms.size());
      EXPECT_LE(max_rel(norms, ref_norms), 1e-12);
      EXPECT_EQ(metric(run, "val_loss"), ref_val);
      // The checkpoint holds the tensors of the run without stages, bit for bit: each expert's
      // parameters and moments written by a copy that holds it.
      const std::string step = "checkpoints/step_00000006";
      const auto mine_ckpt = read_all_tensors(run / step);
      const auto ref_ckpt = read_all_tensors(dir / "ep" / step);
      EXPECT_GT(mine_ckpt.size(), 10u);
      EXPECT_EQ(mine_ckpt.size(), ref_ckpt.size());
      EXPECT_TRUE(mine_ckpt == ref_ckpt)
          << "the pp x ep checkpoint differs from the run without stages'";
    }
  }
  // The pp x ep step-3 checkpoint resumed without stages (dist.ep = 2 on 2 processes) ends where
  // the run without stages ended.
  if (r == 0) {
    fs::create_directories(dir / "back/checkpoints");
    fs::copy(dir / "pp_ep_gpipe/checkpoints/step_00000003", dir / "back/checkpoints/step_00000003");
    std::ofstream(dir / "back/checkpoints/latest") << "step_00000003";
    fs::copy_file(dir / "pp_ep_gpipe/metrics.jsonl", dir / "back/metrics.jsonl");
  }
  world->barrier();
  if (r < 2) {
    Trainer t(make_config(dir / "data", dir / "back", 1, "1f1b", ep), true, half->dup("back"));
    t.run();
    std::vector<float> ref(t.params().size());
    std::ifstream(ref_file(r), std::ios::binary)
        .read(reinterpret_cast<char*>(ref.data()),
              static_cast<std::streamsize>(ref.size() * sizeof(float)));
    const std::vector<float> got(t.params().begin(), t.params().end());
    EXPECT_EQ(differ_held(got, ref, held_values(t)), 0)
        << "the run without stages resumed from the pp x ep checkpoint differs";
  }
  world->barrier();
}

// dist.ep must divide the processes of a stage (here 1 of 2 stages on 2 processes, or 2 of 2
// stages on 4 with dist.ep = 4): refused naming dist.ep, before anything is written.
TEST(Pipeline, RefusesAnExpertGroupThatDoesNotFitTheStage) {
  auto world = dist_world("pipeline_ep_refuse");
  const int W = world->size();
  SharedDir dir(*world, "pipeline_ep_refuse");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const int64_t ep = W < 4 ? 2 : 4;
  const fs::path run = dir / "refused";
  try {
    Trainer t(make_config(dir / "data", run, 2, "1f1b",
                          {"dist.ep=" + std::to_string(ep), "dist.overlap=false"}),
              false, dist_world("refused_ep"));
    ADD_FAILURE() << "dist.ep = " << ep << " with dist.pp = 2 on " << W
                  << " processes was not refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dist.ep = " + std::to_string(ep)), std::string::npos)
        << e.what();
  }
  world->barrier();
  EXPECT_FALSE(fs::exists(run)) << "a refused run wrote " << run;
}
