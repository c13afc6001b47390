// Local SGD (dist.sync = params) on real MPI processes: with H = 1 and plain SGD, averaging the
// parameters after every local step is averaging the gradients (within reduction order); with
// H = 4 the replicas drift apart between averagings, hold the same bits after each, and a resume
// from the checkpoint after an averaging is bit-exact; ZeRO-1,
// a checkpoint interval that is not a multiple of H and bad values are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "parallel/runtime.h"
#include "support/corpus.h"
#include "support/shared_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

RunConfig make_config(const fs::path& dir, const std::string& run, int64_t ep,
                      std::vector<std::string> extra) {
  std::vector<std::string> keys = {"model.dim=32",
                                   "model.n_layers=2",
                                   "model.n_heads=4",
                                   "model.n_kv_heads=2",
                                   "model.expert_hidden=24",
                                   "model.n_experts=4",
                                   "model.top_k=2",
                                   "model.max_seq_len=16",
                                   "train.batch_size=2",
                                   "train.seq_len=16",
                                   "train.steps=8",
                                   "train.eval_every=0",
                                   "train.eval_batches=2",
                                   "train.checkpoint_every=0",
                                   "train.progress=off",
                                   "optim.name=sgd",
                                   "optim.momentum=0",
                                   "optim.lr=0.1",
                                   "optim.warmup_steps=0",
                                   "optim.grad_clip=0",
                                   "data.dir=" + (dir / "data").string(),
                                   "train.run_dir=" + (dir / run).string(),
                                   "dist.bucket_first_mb=0.01",
                                   "dist.bucket_mb=0.05",
                                   "dist.ep=" + std::to_string(ep)};
  keys.insert(keys.end(), extra.begin(), extra.end());
  return load_run_config("", keys);
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

// (step, replica_drift) of the run's averagings.
std::vector<std::pair<int64_t, double>> drifts(const fs::path& run) {
  std::vector<std::pair<int64_t, double>> out;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string l; std::getline(in, l);) {
    auto j = nlohmann::json::parse(l);
    if (j.contains("replica_drift"))
      out.push_back({j["step"].get<int64_t>(), j["replica_drift"].get<double>()});
  }
  return out;
}

}  // namespace

TEST(DistLocalSgd, AveragingParamsEveryStepWithSgdIsAveragingGradients) {
  auto world = dist_world("local_sgd_h1");
  const int P = world->size();
  SharedDir dir(*world, "local_sgd_h1");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  std::vector<int64_t> eps = {1};
  if (P == 4) eps.push_back(2);  // experts averaged over their data-parallel group of 2
  for (int64_t ep : eps) {
    const std::string tag = "_ep" + std::to_string(ep);
    Trainer grads(make_config(dir.path(), "grads" + tag, ep, {}), false, dist_world("g"));
    grads.run();
    Trainer params(make_config(dir.path(), "params" + tag, ep,
                               {"dist.sync=params", "dist.sync_every=1"}),
                   false, dist_world("p"));
    params.run();
    // Reduction order only: the gradient path sums the ranks' contributions scaled by 1/W, the
    // averaging sums the ranks' parameters and scales by 1/P; f32 rounding of values ~0.1 over
    // 8 steps stays below 1e-5 relative to the largest parameter.
    const std::vector<float>& a = grads.params();
    const std::vector<float>& b = params.params();
    double worst = 0, scale = 1e-30;
    for (std::size_t i = 0; i < a.size(); ++i) {
      worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
      scale = std::max(scale, std::fabs(double(a[i])));
    }
    EXPECT_LE(worst / scale, 1e-5) << "ep " << ep;
    if (world->rank() == 0)
      std::printf("%d ranks, ep %lld: local SGD H = 1 vs gradient averaging: max |Δp| / max |p| "
                  "= %.3g\n",
                  P, static_cast<long long>(ep), worst / scale);
  }
  world->barrier();
}

TEST(DistLocalSgd, ReplicasDriftBetweenAveragingsAndAgreeAfterEach) {
  auto world = dist_world("local_sgd_h4");
  const int P = world->size();
  SharedDir dir(*world, "local_sgd_h4");
  if (world->rank() == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const std::vector<std::string> h4 = {"dist.sync=params", "dist.sync_every=4",
                                       "optim.name=adamw", "optim.lr=0.003",
                                       "dist.sync_moments=true"};
  auto same_everywhere = [&](const std::vector<float>& p) {
    const std::vector<int64_t> h = world->allgather_one(static_cast<int64_t>(hash_of(p)));
    for (int q = 1; q < P; ++q)
      if (h[q] != h[0]) return false;
    return true;
  };
  {
    // Stopped at step 2: the checkpoint averages first, and reports how far apart they were.
    Trainer t(make_config(dir.path(), "stop2", 1, h4), false, dist_world("s2"));
    t.run(2);
    EXPECT_TRUE(same_everywhere(t.params()));
    if (world->rank() == 0) {
      const auto d = drifts(dir / "stop2");
      ASSERT_EQ(d.size(), 1u);
      EXPECT_EQ(d[0].first, 2);
      EXPECT_GT(d[0].second, 0.0) << "the replicas' parameters differ at step 2";
    }
  }
  Trainer t(make_config(dir.path(), "h4", 1, h4), false, dist_world("h4"));
  t.run();
  EXPECT_TRUE(same_everywhere(t.params())) << "the replicas differ after the step-8 averaging";
  if (world->rank() == 0) {
    const auto d = drifts(dir / "h4");
    ASSERT_EQ(d.size(), 2u) << "one averaging every 4 steps of 8";
    EXPECT_EQ(d[0].first, 4);
    EXPECT_EQ(d[1].first, 8);
    EXPECT_GT(d[0].second, 0.0);
    EXPECT_GT(d[1].second, 0.0);
  }
  // Stopped right after the step-4 averaging and resumed (moments averaged too): the bits of the
  // straight run.
  {
    Trainer first(make_config(dir.path(), "h4_resumed", 1, h4), false, dist_world("r1"));
    first.run(4);
  }
  Trainer resumed(make_config(dir.path(), "h4_resumed", 1, h4), true, dist_world("r2"));
  resumed.run();
  EXPECT_EQ(hash_of(resumed.params()), hash_of(t.params())) << "resumed run differs";
  world->barrier();
}

TEST(DistLocalSgd, BadSettingsAreRefused) {
  auto refused = [](std::vector<std::string> keys, const std::string& what) {
    try {
      load_run_config("", keys);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused({"dist.sync=weights"}, "dist.sync = 'weights': allowed are grads, params");
  refused({"dist.sync=params", "dist.sync_every=0"}, "dist.sync_every = 0: must be ≥ 1");
  refused({"dist.sync=params", "dist.zero=1"}, "dist.sync = params with dist.zero = 1");
  refused({"dist.sync=params", "dist.sync_every=4", "train.checkpoint_every=6"},
          "train.checkpoint_every = 6 with dist.sync = params: must be a multiple of "
          "dist.sync_every = 4");
  refused({"dist.sync=params", "train.precision=fp16"}, "dist.sync = params with train.precision");
}
