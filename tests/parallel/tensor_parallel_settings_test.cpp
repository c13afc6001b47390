// Settings that change where the gradients and the optimizer state live, under tensor parallelism
// (dist.tp = 2; np 2: one model copy, np 4: two copies, data-parallel), each against the
// one-process run of the same global batch and seed: ZeRO-2 and ZeRO-3 (against the run without
// ZeRO: they change no arithmetic of the update), the optimizer state in a file
// (dist.offload = host_file, against the one-process run with it) and fp16 with its dynamic loss
// scaler (against the one-process fp16 run, with skipped steps).
//
// Why they run: each rank writes only the gradients of what it computed and the reduction sums
// every rank's over the world, so a shard of the reduced gradient (ZeRO-1, 2, 3) holds the whole
// batch's gradient of its elements, whichever ranks computed them; the offloaded state is the
// state of this rank's pieces, streamed through its own file; and the overflow check is summed
// over the world (optim/update.cpp), so every rank takes the scaler's decision on every shard.
//
// Not bitwise, for the reasons of tensor_parallel_test.cpp (the shares' sums reorder float
// additions of ≤ 32 terms: relative error ≤ K·ε = 4e-6 a product), so its bounds hold: losses
// 1e-5, norms 1e-4, parameters 1e-4 of the largest. fp16 has bounds of its own (kFp16Bounds).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "optim/loss_scale.h"
#include "optim/sharded_optimizer.h"
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

struct Outcome : TpFigures {
  int64_t nonzero_grads = 0;   // held values' gradients left in the flat buffer after the run
  bool offloaded = false;      // the optimizer state was in a file
  double loss_scale = 1;       // fp16: the scaler's last scale
  int64_t skipped_steps = 0;   // fp16: steps the scaler skipped
  std::vector<double> scales;  // rank 0 only
  std::vector<bool> skipped;   // rank 0 only
};

// Each step's skip flag (a JSON boolean; fp16 runs only).
std::vector<bool> skip_flags(const fs::path& run) {
  std::vector<bool> out;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("skipped")) out.push_back(j["skipped"].get<bool>());
  }
  return out;
}

Outcome run_trainer(Trainer& t, const fs::path& run) {
  t.run();
  t.gather_params();  // ZeRO-3: the whole model, not only this rank's shard
  Outcome o;
  static_cast<TpFigures&>(o) = tp_figures(t, run);
  for (std::size_t i = 0; i < o.held.size(); ++i) o.nonzero_grads += o.held[i] && t.grads()[i] != 0;
  o.offloaded = t.optimizer().offload_store() != nullptr;
  if (const LossScaler* s = t.loss_scaler()) {
    o.loss_scale = s->raw_scale();
    o.skipped_steps = s->skipped_steps();
  }
  if (t.rank() == 0 && t.loss_scaler())
    o.scales = metric(run, "loss_scale"), o.skipped = skip_flags(run);
  return o;
}

// The one-process run of the whole global batch (a batch of every copy's rows), on every rank.
Outcome run_single(const fs::path& data, int copies, const std::vector<std::string>& extra) {
  TempDir run("tps_single");
  Trainer t(tp_config(data, run.path(), kTpRows * copies, 1, extra), false, make_local_comm());
  return run_trainer(t, run.path());
}

Outcome run_tp(const fs::path& data, const fs::path& run, const std::vector<std::string>& extra) {
  Trainer t(tp_config(data, run, kTpRows, kTp, extra), false, dist_world("tps_run"));
  return run_trainer(t, run);
}

// The tensor-parallel run with `extra` against the one-process run with `single_extra`, within
// `bounds`; its checkpoint holds every rank's values bit for bit. Returns both outcomes for the
// setting's own checks.
std::pair<Outcome, Outcome> expect_follows_single(const std::string& name,
                                                  const std::vector<std::string>& extra,
                                                  const std::vector<std::string>& single_extra,
                                                  TpBounds bounds = {}) {
  auto world = dist_world("tps");
  const int W = world->size(), r = world->rank();
  SharedDir dir(*world, ("tps_" + name).c_str());
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const Outcome ref = run_single(dir / "data", W / kTp, single_extra);
  const Outcome got = run_tp(dir / "data", dir / "run", extra);
  expect_tp_follows(name, r, got, ref, bounds);
  expect_checkpoint_holds(dir / "run", got);
  world->barrier();
  return {got, ref};
}

}  // namespace

// ZeRO-2 reduce-scatters each bucket as it is final and steps the shard; ZeRO-3 also gathers each
// block's parameters where the model uses them; both with the experts sharded over the ranks
// (dist.ep = 2). The shards of the reduced gradient are the one-process gradient's elements, so
// both follow the one-process run without ZeRO; also ZeRO-2 with two micro-batches a step, where
// it reduces each micro-batch's buckets into the shard. The
// reduced buckets are released (a gradient left in the flat buffer would mean no ZeRO-2 ran).
TEST(TensorParallelSettings, ZeroTwoAndThreeFollowTheOneProcessRun) {
  for (const std::string zero : {"2", "3"}) {
    SCOPED_TRACE("dist.zero = " + zero + ", dist.ep = 2");
    const auto [got, ref] =
        expect_follows_single("zero" + zero, {"dist.zero=" + zero, "dist.ep=2"}, {});
    EXPECT_EQ(got.nonzero_grads, 0) << "ZeRO-" << zero << " left gradients in the flat buffer";
  }
  SCOPED_TRACE("dist.zero = 2, train.grad_accum = 2");
  const auto [got, ref] = expect_follows_single(
      "zero2_accum", {"dist.zero=2", "train.grad_accum=2"}, {"train.grad_accum=2"});
  EXPECT_EQ(got.nonzero_grads, 0) << "ZeRO-2 left gradients in the flat buffer";
}

// The optimizer state in a file, each rank its own (whole state; under ZeRO-1 its shard), against
// the one-process run with its state in a file.
TEST(TensorParallelSettings, OffloadedStateFollowsTheOneProcessRun) {
  for (const std::string zero : {"0", "1"}) {
    SCOPED_TRACE("dist.zero = " + zero);
    const auto [got, ref] = expect_follows_single(
        "offload" + zero, {"dist.offload=host_file", "dist.zero=" + zero},
        {"dist.offload=host_file"});
    EXPECT_TRUE(got.offloaded) << "no state file under dist.zero = " << zero;
    EXPECT_TRUE(ref.offloaded);
  }
}

// fp16 with a first scale of 2^24, which overflows the fp16 GEMM operands: the scaler skips
// steps. Every rank of every copy skips the same steps as the one-process fp16 run (the same
// count, the same scale, each step's flag on rank 0), so the parameters follow it; with the
// experts sharded (dist.ep = 2), and under ZeRO-2, where each rank checks only its shard of the
// gradient and the agreement over the world is what makes a rank skip on another's overflow;
// and under sequence parallelism.
//
// The bounds are fp16's: both runs round the same f32 weights and activations to 11-bit GEMM
// operands, but where a reordered f32 sum (≤ 4e-6 relative) lies across an fp16 rounding
// boundary, the runs' operands differ by one fp16 unit, 2^-11 = 4.9e-4 relative: a perturbation of
// the size of fp16's own rounding, not of f32's. Gradient norms then agree within 2^-11; the
// parameters within 4·2^-11 = 2e-3 of the largest (AdamW's update is ~lr whatever a gradient's
// size, so an element whose gradient is within such a perturbation of zero can step either way,
// over 20 steps of lr); the losses, means over 512 tokens of log-softmaxes taken in f32, within
// 1e-5 as in f32 (measured ≤ 2e-6).
constexpr TpBounds kFp16Bounds{.loss = 1e-5, .norm = 0x1p-11, .param = 4 * 0x1p-11};

TEST(TensorParallelSettings, FloatSixteenSkipsWithTheOneProcessRun) {
  const std::vector<std::string> fp16 = {"train.precision=fp16", "train.loss_scale_init=16777216",
                                         "train.loss_scale_growth_interval=2"};
  // Also under sequence parallelism, where each rank's overflow check sees the gradients of its
  // own tokens' norms and MoE layers.
  const std::vector<std::pair<std::string, std::vector<std::string>>> settings = {
      {"fp16_zero0", {"dist.zero=0", "dist.ep=2"}},
      {"fp16_zero2", {"dist.zero=2", "dist.ep=2"}},
      {"fp16_sp", {"dist.sequence_parallel=true"}}};
  for (const auto& [name, setting] : settings) {
    SCOPED_TRACE(name);
    std::vector<std::string> keys = fp16;
    keys.insert(keys.end(), setting.begin(), setting.end());
    const auto [got, ref] = expect_follows_single(name, keys, fp16, kFp16Bounds);
    EXPECT_GT(ref.skipped_steps, 0) << "no step overflowed";
    EXPECT_LT(ref.skipped_steps, kTpSteps) << "every step overflowed";
    EXPECT_EQ(got.skipped_steps, ref.skipped_steps);
    EXPECT_EQ(got.loss_scale, ref.loss_scale);
    auto world = dist_world("tps_fp16");
    if (world->rank() != 0) continue;
    EXPECT_EQ(got.skipped.size(), static_cast<std::size_t>(kTpSteps));
    EXPECT_EQ(got.skipped, ref.skipped);
    EXPECT_EQ(got.scales, ref.scales);
  }
}
