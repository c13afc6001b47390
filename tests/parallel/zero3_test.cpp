// ZeRO-3 (dist.zero = 3) in real MPI processes: the parameters sharded between steps (what a rank
// holds of the flat buffer is its shard; the rest reads zero until gathered), forward and backward
// on units gathered just in time with the next one prefetched; bitwise ZeRO-1 where the sums are
// the same (no clipping: the norm's order follows the buckets, cut at unit boundaries under
// ZeRO-3), with overlap and without, bf16 and fp16 compute, bf16 on the wire, expert parallelism,
// recomputation and offload; clipping and gradient accumulation within the reduction-order bound
// of the one-process run; a bit-exact resume; checkpoints loaded across stages both ways; the
// settings it refuses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/check.h"
#include "model/params.h"
#include "parallel/runtime.h"
#include "support/checkpoint_tensors.h"
#include "support/corpus.h"
#include "support/expect_error.h"
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

constexpr int64_t kRowsPerRank = 2;
constexpr int64_t kSteps = 8;

struct RunSetup {
  int64_t zero = 3, grad_accum = 1, ep = 1, checkpoint_every = 0, layers = 3;
  bool overlap = true;
  double clip = 0;
  std::string wire = "f32", precision = "f32";
  std::vector<std::string> extra;  // further key=value settings
};

std::vector<std::string> settings(const RunSetup& s, const fs::path& data, const fs::path& run,
                                  int64_t batch) {
  std::vector<std::string> out = {"model.dim=64",
                                  "model.n_layers=" + std::to_string(s.layers),
                                  "model.n_heads=4",
                                  "model.n_kv_heads=2",
                                  "model.expert_hidden=96",
                                  "model.n_experts=4",
                                  "model.top_k=2",
                                  "model.max_seq_len=16",
                                  "model.bias_update_rate=0.01",
                                  "train.batch_size=" + std::to_string(batch),
                                  "train.seq_len=16",
                                  "train.steps=" + std::to_string(kSteps),
                                  "train.grad_accum=" + std::to_string(s.grad_accum),
                                  "train.precision=" + s.precision,
                                  "train.eval_every=4",
                                  "train.eval_batches=1",
                                  "train.checkpoint_every=" + std::to_string(s.checkpoint_every),
                                  "train.keep_checkpoints=3",
                                  "train.progress=off",
                                  "optim.warmup_steps=3",
                                  "optim.grad_clip=" + std::to_string(s.clip),
                                  "data.dir=" + data.string(),
                                  "train.run_dir=" + run.string(),
                                  "dist.ep=" + std::to_string(s.ep),
                                  "dist.zero=" + std::to_string(s.zero),
                                  "dist.grad_reduce_dtype=" + s.wire,
                                  "dist.bucket_first_mb=0.01",
                                  "dist.bucket_mb=0.05",
                                  std::string("dist.overlap=") + (s.overlap ? "true" : "false")};
  out.insert(out.end(), s.extra.begin(), s.extra.end());
  return out;
}

struct Outcome {
  std::vector<float> params;  // whole (gathered after the run)
  std::vector<char> held;     // 1 where this rank holds the value: all but others' experts
  std::vector<double> losses, grad_norms;  // rank 0 only
  double zero_share = 0;  // of the held values reading 0 before the gather
  double zero_share_at_init = 0;  // the same after --init-from, before the first step
  std::vector<float> params_at_init;  // whole (gathered) after --init-from
};

double zero_share(Trainer& t, const std::vector<char>& held) {
  int64_t zeros = 0, n = 0;
  for (std::size_t i = 0; i < held.size(); ++i)
    if (held[i]) ++n, zeros += t.params()[i] == 0.0f;
  return static_cast<double>(zeros) / static_cast<double>(n);
}

Outcome run(const RunSetup& s, const fs::path& data, const fs::path& dir, int64_t stop_at = -1,
            bool resume = false, const fs::path& init_from = {}) {
  Trainer t(load_run_config("", settings(s, data, dir, kRowsPerRank)), resume,
            dist_world("zero3_test"));
  Outcome o;
  o.held = held_values(t);
  if (!init_from.empty()) {
    t.init_weights_from(init_from);
    o.zero_share_at_init = zero_share(t, o.held);
    t.gather_params();
    o.params_at_init = t.params();
  }
  t.run(stop_at);
  o.zero_share = zero_share(t, o.held);
  t.gather_params();
  o.params = t.params();
  if (t.rank() == 0) o.losses = metric(dir, "loss"), o.grad_norms = metric(dir, "grad_norm");
  return o;
}

int64_t differ(const Outcome& a, const Outcome& b) { return differ_held(a.params, b.params, a.held); }

// The largest difference of a held parameter, relative to the largest parameter.
double param_rel(const Outcome& got, const std::vector<float>& ref) {
  double worst = 0, scale = 1e-30;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!got.held[i]) continue;
    worst = std::max(worst, std::abs(double(got.params[i]) - ref[i]));
    scale = std::max(scale, std::abs(double(ref[i])));
  }
  return worst / scale;
}

}  // namespace

TEST(Zero3, EqualsZeroOneBitForBitAndHoldsOnlyItsShard) {
  auto world = dist_world("zero3_bits");
  const int W = world->size();
  SharedDir dir(*world, "zero3_bits");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  RunSetup f32;
  RunSetup bf16;  // bf16 GEMM operands (each unit's copy made as it is gathered), bf16 wire
  bf16.precision = "bf16", bf16.wire = "bf16";
  RunSetup fp16;  // fp16 loss scaling, gathers and reductions inline (no communication thread)
  fp16.precision = "fp16", fp16.overlap = false;
  RunSetup ep;  // experts sharded over their expert-data-parallel group, blocks recomputed
  ep.ep = 2, ep.extra = {"train.recompute=full", "dist.a2a_chunks=2"};
  RunSetup offload;  // optimizer state in a file, MoE intermediates recomputed
  offload.extra = {"dist.offload=host_file", "train.recompute=moe"};
  int k = 0;
  for (RunSetup s : {f32, bf16, fp16, ep, offload}) {
    SCOPED_TRACE("setup " + std::to_string(k));
    const std::string tag = std::to_string(k++);
    s.zero = 1;
    const Outcome one = run(s, dir / "data", dir / ("z1_" + tag));
    s.zero = 3;
    const Outcome three = run(s, dir / "data", dir / ("z3_" + tag));
    EXPECT_EQ(differ(one, three), 0) << "ZeRO-3 parameters differ from ZeRO-1's";
    // Between steps a rank holds its shard (1/W of each unit, some pages at the edges kept; under
    // expert parallelism its experts are shared by W / ep ranks only).
    EXPECT_LT(one.zero_share, 0.01);
    const double released = s.ep == 1 ? 1.0 - 1.0 / W : 0.1 * (1.0 - 1.0 / W);
    EXPECT_GT(three.zero_share, 0.9 * released - 0.15) << "W = " << W;
    if (world->rank() == 0) {
      ASSERT_EQ(three.losses.size(), static_cast<std::size_t>(kSteps));
      EXPECT_EQ(one.losses, three.losses);
      EXPECT_LT(three.losses.back(), three.losses.front());
    }
  }
}

TEST(Zero3, ClippingAndAccumulationFollowTheOneProcessRun) {
  auto world = dist_world("zero3_accum");
  const int W = world->size();
  SharedDir dir(*world, "zero3_accum");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  RunSetup s;
  s.grad_accum = 2, s.clip = 0.5;
  s.ep = W >= 4 ? 2 : 1;
  TempDir single("zero3_single");
  RunSetup one = s;
  one.zero = 0, one.ep = 1;
  Trainer t(load_run_config("", settings(one, dir / "data", single.path(), kRowsPerRank * W)),
            false, make_local_comm());
  t.run();
  const std::vector<float> ref = t.params();
  const std::vector<double> ref_losses = metric(single.path(), "loss");
  const std::vector<double> ref_norms = metric(single.path(), "grad_norm");
  const Outcome got = run(s, dir / "data", dir / "overlapped");
  s.overlap = false;
  const Outcome blocking = run(s, dir / "data", dir / "blocking");
  EXPECT_EQ(differ(got, blocking), 0);
  if (world->rank() == 0) {
    ASSERT_EQ(got.losses.size(), ref_losses.size());
    EXPECT_LE(max_rel(got.losses, ref_losses), 1e-5);
    EXPECT_LE(max_rel(got.grad_norms, ref_norms), 1e-4);
    EXPECT_EQ(got.losses, blocking.losses);
  }
  EXPECT_LE(param_rel(got, ref), 1e-4);
}

TEST(Zero3, ResumesBitExactAndCheckpointsLoadAcrossStages) {
  auto world = dist_world("zero3_ckpt");
  const int W = world->size();
  SharedDir dir(*world, "zero3_ckpt");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  RunSetup s;
  s.ep = W >= 4 ? 2 : 1, s.checkpoint_every = 4;
  const Outcome z3 = run(s, dir / "data", dir / "z3");
  run(s, dir / "data", dir / "z3_resumed", 4);
  const Outcome z3_resumed = run(s, dir / "data", dir / "z3_resumed", -1, true);
  EXPECT_EQ(differ(z3_resumed, z3), 0) << "resumed ZeRO-3 run differs from the straight one";
  s.zero = 1;
  const Outcome z1 = run(s, dir / "data", dir / "z1");
  EXPECT_EQ(differ(z1, z3), 0);
  if (world->rank() == 0) {
    EXPECT_EQ(z3_resumed.losses, z3.losses);
    const std::string step = "checkpoints/step_00000008";
    auto t3 = read_all_tensors(dir / ("z3/" + step));
    EXPECT_GT(t3.size(), 0u);
    EXPECT_TRUE(t3 == read_all_tensors(dir / ("z1/" + step)));
    copy_checkpoint(dir.path(), "z3", "z3_as_z1", 4);
    copy_checkpoint(dir.path(), "z1", "z1_as_z3", 4);
  }
  world->barrier();
  struct Cross {
    const char* dir;
    int64_t zero;
    const Outcome* straight;
  };
  for (const Cross& c : {Cross{"z3_as_z1", 1, &z3}, Cross{"z1_as_z3", 3, &z1}}) {
    SCOPED_TRACE(c.dir);
    s.zero = c.zero;
    const Outcome resumed = run(s, dir / "data", dir / c.dir, -1, true);
    EXPECT_EQ(differ(resumed, *c.straight), 0);
    if (world->rank() == 0) {
      EXPECT_EQ(resumed.losses, c.straight->losses);
    }
  }
  // --init-from another run's checkpoint: under ZeRO-3 each rank reads its shard of the weights
  // (and holds nothing else before the first step); the run then follows the ZeRO-1 one bitwise.
  const fs::path from = dir / "z1/checkpoints/step_00000008";
  s.zero = 1;
  const Outcome init1 = run(s, dir / "data", dir / "init_z1", -1, false, from);
  s.zero = 3;
  const Outcome init3 = run(s, dir / "data", dir / "init_z3", -1, false, from);
  EXPECT_EQ(differ(init1, init3), 0);
  // What each rank holds is the checkpoint's weights: the z1 run's at its end.
  EXPECT_EQ(differ_held(init1.params_at_init, z1.params, z1.held), 0);
  EXPECT_EQ(differ_held(init3.params_at_init, z1.params, z1.held), 0);
  EXPECT_LT(init1.zero_share_at_init, 0.01);
  const double released = s.ep == 1 ? 1.0 - 1.0 / W : 0.1 * (1.0 - 1.0 / W);
  EXPECT_GT(init3.zero_share_at_init, 0.9 * released - 0.15) << "W = " << W;
  if (world->rank() == 0) {
    EXPECT_EQ(init1.losses, init3.losses);
    // Started from the trained weights: the first loss is below the first loss from scratch.
    ASSERT_FALSE(init1.losses.empty());
    EXPECT_LT(init1.losses[0], z1.losses[0] - 0.1);
  }
}

TEST(Zero3, RefusedSettingsNameTheKeys) {
  auto load = [](std::vector<std::string> sets) { return [sets] { load_run_config("", sets); }; };
  expect_error(load({"dist.zero=3", "grad.sparse_ratio=0.5"}),
               {"dist.zero = 3 with grad.sparse_ratio = 0.5"});
  expect_error(load({"dist.zero=3", "grad.sparse_experts=true"}),
               {"dist.zero = 3 with grad.sparse_experts = true"});
  expect_error(load({"dist.zero=3", "dist.grad_reduce_dtype=int8"}),
               {"dist.zero = 3 with dist.grad_reduce_dtype = int8"});
  expect_error(load({"dist.zero=3", "dist.sync=params"}),
               {"dist.sync = params with dist.zero = 3"});
  expect_error(load({"dist.zero=3", "placement.spare_slots=1", "dist.ep=2"}),
               {"dist.zero = 3 with placement.spare_slots = 1"});
}
