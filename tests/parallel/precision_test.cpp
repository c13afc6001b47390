// Low-precision communication under MPI: the bf16 gradient reduction against its closed form (the
// bf16-rounded contributions summed in f32 in rank order, all-gathered as bf16), against the f32
// reduction within bf16 tolerance, identical on every rank, run to run, with half the bytes; the
// bf16 all-to-all delivers the rounded rows; bf16 training matches the single-process bf16 run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/params.h"
#include "parallel/alltoall.h"
#include "parallel/grad_sync.h"
#include "parallel/groups.h"
#include "parallel/runtime.h"
#include "support/corpus.h"
#include "support/gradcheck.h"
#include "support/small_models.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

ModelConfig small_model() {
  ModelConfig c = moetrain::testing::small_lm(64, 32, 24, 2);
  c.max_seq_len = 16;
  return c;
}

uint64_t hash_of(const std::vector<float>& v) {
  uint64_t h = 1469598103934665603ull;
  for (float f : v) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    h = (h ^ u) * 1099511628211ull;
  }
  return h;
}

// Every rank's gradients are random, seeded by the rank: any rank can rebuild any other's.
std::vector<float> grads_of(int rank, int64_t n) {
  return random_vector(n, 1000 + static_cast<uint64_t>(rank), 0.01f);
}

struct Reduced {
  std::vector<float> grads;
  int64_t bytes = 0;
};

Reduced reduce(const ParamLayout& layout, ProcessGroups& pg, GradWire wire, int rank) {
  GradSyncConfig gc;
  gc.first_bucket_bytes = 4096;  // several buckets of each kind
  gc.bucket_bytes = 20000;
  gc.wire = wire;
  GradSync sync(sync_ranges(layout, {0, small_model().n_experts}), *pg.grads, *pg.expert_grads, gc);
  Reduced r;
  r.grads = grads_of(rank, layout.size());
  sync.reduce_scatter(r.grads.data());
  sync.allgather_grads(r.grads.data());
  r.bytes = sync.bytes_sent();
  return r;
}

}  // namespace

TEST(DistPrecision, Bf16GradientReductionIsItsClosedFormOnEveryRank) {
  auto world = dist_world("precision");
  const int P = world->size(), rank = world->rank();
  ProcessGroups pg = make_process_groups(*world, 1);
  ParamLayout layout(small_model());
  const int64_t n = layout.size();
  const Reduced f32 = reduce(layout, pg, GradWire::F32, rank);
  const Reduced bf = reduce(layout, pg, GradWire::BF16, rank);
  // Closed form: round each rank's gradients to bf16, add in rank order in f32, round to bf16.
  std::vector<std::vector<float>> all;
  for (int q = 0; q < P; ++q) all.push_back(grads_of(q, n));
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) {
    float s = bf16_round(all[0][i]);
    for (int q = 1; q < P; ++q) s += bf16_round(all[q][i]);
    differ += bf16_round(s) != bf.grads[i];
  }
  EXPECT_EQ(differ, 0);
  // Within bf16 tolerance of the f32 reduction: each of the ≤ 4 contributions (|g| ≲ 0.05)
  // and the sum are off by at most half a bf16 ulp (2^-9 relative).
  expect_close(bf.grads.data(), f32.grads.data(), n, 3e-4, 1e-2, "bf16 vs f32 reduction");
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num += std::pow(double(bf.grads[i]) - f32.grads[i], 2);
    den += std::pow(double(f32.grads[i]), 2);
  }
  EXPECT_LT(std::sqrt(num / den), 5e-3);
  // The same bits on every rank, and run to run.
  const std::vector<int64_t> hashes = world->allgather_one(static_cast<int64_t>(hash_of(bf.grads)));
  for (int q = 0; q < P; ++q) EXPECT_EQ(hashes[q], hashes[0]) << "rank " << q;
  EXPECT_EQ(hash_of(reduce(layout, pg, GradWire::BF16, rank).grads), hash_of(bf.grads));
  // Half the bytes on the wire.
  EXPECT_GT(f32.bytes, 0);
  EXPECT_EQ(bf.bytes * 2, f32.bytes);
  if (rank == 0)
    std::printf(
        "gradient reduction of %lld floats over %d ranks: %lld bytes sent per rank in "
        "f32, %lld in bf16\n",
        static_cast<long long>(n), P, static_cast<long long>(f32.bytes),
        static_cast<long long>(bf.bytes));
}

TEST(DistPrecision, Bf16AllToAllDeliversTheRoundedRows) {
  auto world = dist_world("precision_a2a");
  const int P = world->size(), rank = world->rank();
  const int64_t El = 2, E = El * P, C = 5;
  std::vector<int64_t> counts(E);
  int64_t R = 0;
  for (int64_t e = 0; e < E; ++e) R += counts[e] = (rank * 3 + e * 5) % 4;
  const std::vector<float> send = random_vector(R * C, 50 + rank);
  A2aRoute route{world.get()};
  A2aLayout plan;
  a2a_plan(plan, route, counts.data(), E, C);
  A2aScratch s32, s16;
  std::vector<float> got32(plan.R_recv * C + 1), got16(plan.R_recv * C + 1);
  a2a_dispatch(got32.data(), send.data(), plan, route, s32);
  a2a_dispatch(got16.data(), send.data(), plan, route, s16, DType::BF16);
  for (int64_t i = 0; i < plan.R_recv * C; ++i) ASSERT_EQ(got16[i], bf16_round(got32[i])) << i;
  std::vector<float> back(R * C + 1);
  a2a_combine(back.data(), got16.data(), plan, route, s16, DType::BF16);
  for (int64_t i = 0; i < R * C; ++i) ASSERT_EQ(back[i], bf16_round(send[i])) << i;
  EXPECT_THROW(a2a_dispatch(got16.data(), send.data(), plan, route, s16, DType::F16), Error);
}

TEST(DistPrecision, Bf16TrainingWithBf16CommunicationMatchesOneProcess) {
  auto world = dist_world("precision_train");
  const int P = world->size();
  std::string dir;
  std::unique_ptr<TempDir> own;
  if (world->rank() == 0) {
    own = std::make_unique<TempDir>("dist_precision");
    dir = own->path().string();
    write_corpus(own->path() / "data", 40000);
  }
  int64_t len = static_cast<int64_t>(dir.size());
  world->broadcast(&len, sizeof(len));
  dir.resize(static_cast<std::size_t>(len));
  world->broadcast(dir.data(), len);
  auto config = [&](int64_t batch, const std::string& run, const std::string& wire, int64_t ep) {
    return load_run_config("", {"model.dim=32",
                                "model.n_layers=2",
                                "model.n_heads=4",
                                "model.n_kv_heads=2",
                                "model.expert_hidden=24",
                                "model.n_experts=4",
                                "model.top_k=2",
                                "model.max_seq_len=16",
                                "train.batch_size=" + std::to_string(batch),
                                "train.seq_len=16",
                                "train.steps=12",
                                "train.eval_every=0",
                                "train.eval_batches=2",
                                "train.progress=off",
                                "train.precision=bf16",
                                "optim.warmup_steps=3",
                                "data.dir=" + dir + "/data",
                                "train.run_dir=" + dir + "/" + run,
                                "dist.bucket_first_mb=0.01",
                                "dist.bucket_mb=0.05",
                                "dist.ep=" + std::to_string(ep),
                                "dist.grad_reduce_dtype=" + wire,
                                "dist.a2a_dtype=" + wire});
  };
  auto lines = [&](const std::string& run) {
    std::vector<nlohmann::json> out;
    std::ifstream in(fs::path(dir) / run / "metrics.jsonl");
    for (std::string l; std::getline(in, l);) {
      auto j = nlohmann::json::parse(l);
      if (j.contains("loss")) out.push_back(j);
    }
    return out;
  };
  TempDir single("single");
  double single_val = 0;
  {
    RunConfig c = config(2 * P, "unused", "f32", 1);
    c.train.run_dir = single.path().string();
    single_val = Trainer(c, false, make_local_comm()).run().val_loss;
  }
  const int64_t ep = P % 2 == 0 ? 2 : 1;  // data and expert parallel at 4 ranks
  double f32_val = Trainer(config(2, "f32", "f32", ep), false, dist_world("t1")).run().val_loss;
  double bf_val = Trainer(config(2, "bf16", "bf16", ep), false, dist_world("t2")).run().val_loss;
  // The same on every rank; within 1% of the one-process run (bf16 rounding of what travels).
  EXPECT_NEAR(f32_val, single_val, 1e-3 * single_val);
  EXPECT_NEAR(bf_val, single_val, 1e-2 * single_val);
  if (world->rank() == 0) {
    const auto a = lines("f32"), b = lines("bf16");
    ASSERT_EQ(a.size(), 12u);
    ASSERT_EQ(b.size(), 12u);
    const int64_t bytes32 = a.back()["bytes_grad"].get<int64_t>();
    const int64_t bytes16 = b.back()["bytes_grad"].get<int64_t>();
    EXPECT_EQ(bytes16 * 2, bytes32);
    std::printf(
        "%d ranks, ep %lld: gradient sync %lld bytes per step per rank in f32, %lld in "
        "bf16; validation loss one process %.4f, f32 %.4f, bf16 %.4f\n",
        P, static_cast<long long>(ep), static_cast<long long>(bytes32),
        static_cast<long long>(bytes16), single_val, f32_val, bf_val);
  }
  // fp16: the overflow decision is taken on the summed flag, so every rank skips the same
  // steps and keeps the same scale.
  {
    RunConfig c = config(2, "fp16", "f32", ep);
    c.train.precision = Precision::FP16;
    c.train.loss_scale_init = 268435456.0;  // 2^28: the first steps overflow
    Trainer t(c, false, dist_world("t3"));
    t.run();
    const auto skipped = world->allgather_one(t.loss_scaler()->skipped_steps());
    const auto scale = world->allgather_one(static_cast<int64_t>(t.loss_scaler()->raw_scale()));
    EXPECT_GT(skipped[0], 0);
    for (int q = 0; q < P; ++q) {
      EXPECT_EQ(skipped[q], skipped[0]);
      EXPECT_EQ(scale[q], scale[0]);
    }
  }
  world->barrier();
}
