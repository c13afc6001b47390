// The distributed classifier against the one-process run with the same global batch and seed:
// each rank takes its rows of every batch, the MoE layers reduce their balancing statistics over
// every process (and, with dist.ep > 1, send tokens to the ranks holding their experts), the
// gradients are summed by the same reducer, and the run follows the one-process run. Not bit for
// bit: the per-row terms are the same, but every sum over rows (gradients, expert loads, the aux
// loss's statistics) is split over the processes and added in another order. Each such sum of n
// float terms moves by at most ~n·eps relative (n = 32 rows, eps = 6e-8: ~2e-6); Adam divides
// by the gradients' own scale, so over 12 steps the parameters drift further than a single sum
// would: 1e-4 of the largest parameter and 1e-5 of a step's loss hold with a wide margin and
// still catch a wrong gradient or a per-rank statistic (those move the loss by 1e-3 and more).
// Every run is interrupted at step 5 and resumed, and its checkpoint, written by every rank, loads
// back as the parameters the ranks hold.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "data/idx.h"
#include "io/metrics.h"
#include "parallel/runtime.h"
#include "support/image_rows.h"
#include "support/run_metrics.h"
#include "support/shared_dir.h"
#include "support/temp_dir.h"
#include "train/classifier_config.h"
#include "train/classifier_trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kSteps = 12;

const ClassifierData& data() {
  static const ImageDataset t10k = load_fashion_mnist("t10k");
  static const ClassifierData d{image_rows(t10k, 0, 2000), image_rows(t10k, 2000, 300)};
  return d;
}

// The default topk_softmax router with the aux and z losses on, dropless: the balancing loss
// depends on the whole batch's routing, so per-rank statistics would show.
ClassifierRunConfig config(const fs::path& run, std::vector<std::string> more = {}) {
  std::vector<std::string> o = {"model.dim=32",
                                "model.n_layers=2",
                                "model.expert_hidden=32",
                                "model.n_experts=4",
                                "model.top_k=2",
                                "model.aux_loss_coef=0.05",
                                "model.z_loss_coef=0.001",
                                "model.capacity_factor=0",
                                "train.steps=" + std::to_string(kSteps),
                                "train.batch_size=32",
                                "train.eval_every=5",
                                "train.eval_batch_size=128",
                                "train.progress=off",
                                "optim.warmup_steps=3",
                                "optim.grad_clip=0.5",
                                "train.threads=1",
                                "train.run_dir=" + run.string()};
  o.insert(o.end(), more.begin(), more.end());
  return load_classifier_config("", o);
}

std::vector<double> metric(const std::vector<nlohmann::json>& lines, const char* key) {
  std::vector<double> out;
  for (const auto& j : lines)
    if (j.contains(key)) out.push_back(j[key].get<double>());
  return out;
}

// The one-process run, once per process (every rank needs its parameters).
const std::vector<float>& reference(const fs::path& run) {
  static std::vector<float> params;
  if (params.empty()) {
    ClassifierTrainer t(config(run), data(), false, make_local_comm());
    t.run();
    params = t.params();
  }
  return params;
}

void expect_matches_one_process(const char* name, const std::vector<std::string>& dist) {
  auto world = dist_world("classifier");
  SharedDir dir(*world, name);
  static TempDir single("single");
  const std::vector<float>& ref = reference(single.path());
  const fs::path run = dir / "run";
  std::vector<float> got;
  std::vector<bool> held;
  {
    {
      ClassifierTrainer a(config(run, dist), data(), false, dist_world("a"));
      a.run(5);
    }  // one run at a time holds the directory
    ClassifierTrainer t(config(run, dist), data(), true, dist_world("b"));
    EXPECT_EQ(t.step(), 5);
    t.run();
    got = t.params();
    const ExpertShard& s = t.expert_shard();
    held.assign(got.size(), false);
    for (const ParamInfo& p : t.model().layout().params())
      std::fill_n(held.begin() + p.offset, p.numel,
                  p.expert < 0 || (p.expert >= s.first && p.expert < s.first + s.count));
  }
  if (world->rank() == 0) {
    const auto a = read_metrics(single.path()), b = read_metrics(run);
    ASSERT_EQ(metric(b, "loss").size(), static_cast<std::size_t>(kSteps));
    EXPECT_GT(metric(a, "aux").back(), 0.1);  // the balancing loss is there to be matched
    EXPECT_LE(max_rel(metric(b, "loss"), metric(a, "loss")), 1e-5);
    EXPECT_LE(max_rel(metric(b, "aux"), metric(a, "aux")), 1e-5);
    EXPECT_LE(max_rel(metric(b, "grad_norm"), metric(a, "grad_norm")), 1e-4);
    EXPECT_LE(max_rel(metric(b, "test_loss"), metric(a, "test_loss")), 1e-5);
    EXPECT_EQ(metric(b, "test_loss").size(), metric(a, "test_loss").size());
    // Every step line has each rank's own step time; the one-process run has none.
    for (const auto& j : b)
      if (j.contains("step_time_s")) {
        const auto t = j.value("rank_step_time_s", std::vector<double>{});
        ASSERT_EQ(t.size(), static_cast<std::size_t>(world->size())) << j.dump();
        for (double x : t) EXPECT_GT(x, 0);
      }
    for (const auto& j : a) EXPECT_FALSE(j.contains("rank_step_time_s"));
  }
  // The collective checkpoint holds the whole model: against the one-process run, and bit for bit
  // the values each rank holds.
  LoadedClassifier m = load_classifier(run);
  EXPECT_EQ(m.step, kSteps);
  ASSERT_EQ(m.params.size(), ref.size());
  ASSERT_EQ(got.size(), ref.size());
  double worst = 0, scale = 1e-30;
  int64_t differ = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    worst = std::max(worst, std::abs(double(m.params[i]) - ref[i]));
    scale = std::max(scale, std::abs(double(ref[i])));
    differ += held[i] && m.params[i] != got[i];
  }
  EXPECT_LE(worst / scale, 1e-4);
  EXPECT_EQ(differ, 0);
}

}  // namespace

TEST(DistClassifier, DataParallelMatchesOneProcessAndResumes) {
  expect_matches_one_process("dist_classifier_dp", {});
}

TEST(DistClassifier, ExpertParallelMatchesOneProcessAndResumes) {
  expect_matches_one_process("dist_classifier_ep", {"dist.ep=2"});
}

TEST(DistClassifier, ZeroOneWithExpertParallelMatchesOneProcessAndResumes) {
  expect_matches_one_process("dist_classifier_zero", {"dist.ep=2", "dist.zero=1"});
}
