// The data-parallel classifier against the one-process run with the same global batch and seed:
// each rank takes its rows of every batch, gradients are summed by the same reducer, and the run
// follows the one-process run (rounding aside); its checkpoint, written by every rank, loads back
// as the parameters every rank holds.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "data/idx.h"
#include "io/metrics.h"
#include "parallel/runtime.h"
#include "support/shared_dir.h"
#include "support/temp_dir.h"
#include "train/classifier_config.h"
#include "train/classifier_trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

std::shared_ptr<const ImageDataset> rows(const ImageDataset& d, int64_t begin, int64_t n) {
  auto out = std::make_shared<ImageDataset>();
  const int64_t D = d.rows * d.cols;
  out->n = n, out->rows = d.rows, out->cols = d.cols, out->num_classes = d.num_classes;
  out->images.assign(d.images.begin() + begin * D, d.images.begin() + (begin + n) * D);
  out->labels.assign(d.labels.begin() + begin, d.labels.begin() + begin + n);
  return out;
}

// sigmoid_bias without the aux loss and dropless routing: every term of the loss is a mean over
// rows, so splitting the batch changes only the rounding. (A balancing loss from per-rank
// statistics would differ: that needs the statistics reduced inside the MoE layer, as the expert
// exchange does for the LM.)
ClassifierRunConfig config(const fs::path& run, int64_t steps) {
  return load_classifier_config(
      "", {"model.dim=32", "model.n_layers=2", "model.expert_hidden=32", "model.n_experts=4",
           "model.top_k=2", "model.router=sigmoid_bias", "model.aux_loss_coef=0",
           "model.capacity_factor=0", "model.bias_update_rate=0.01",
           "train.steps=" + std::to_string(steps), "train.batch_size=32", "train.eval_every=5",
           "train.eval_batch_size=128", "train.progress=off", "optim.warmup_steps=3",
           "optim.grad_clip=0.5", "train.threads=1", "train.run_dir=" + run.string()});
}

std::vector<double> metric(const std::vector<nlohmann::json>& lines, const char* key) {
  std::vector<double> out;
  for (const auto& j : lines)
    if (j.contains(key)) out.push_back(j[key].get<double>());
  return out;
}

double max_rel(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(1e-12, std::abs(b[i])));
  return worst;
}

}  // namespace

TEST(DistClassifier, DataParallelMatchesOneProcessAndResumes) {
  auto world = dist_world("classifier");
  SharedDir dir(*world, "dist_classifier");
  static const ImageDataset t10k = load_fashion_mnist("t10k");
  ClassifierData data{rows(t10k, 0, 2000), rows(t10k, 2000, 300)};
  constexpr int64_t kSteps = 12;

  TempDir single("single");
  std::vector<float> ref;
  {
    ClassifierTrainer t(config(single.path(), kSteps), data, false, make_local_comm());
    t.run();
    ref = t.params();
  }
  std::vector<float> got;
  {
    // Interrupted at step 5 and resumed: the distributed run's checkpoints resume on P ranks.
    ClassifierTrainer a(config(dir / "run", kSteps), data, false, dist_world("a"));
    a.run(5);
    ClassifierTrainer t(config(dir / "run", kSteps), data, true, dist_world("b"));
    EXPECT_EQ(t.step(), 5);
    t.run();
    got = t.params();
  }
  ASSERT_EQ(got.size(), ref.size());
  double worst = 0, scale = 1e-30;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    worst = std::max(worst, std::abs(double(got[i]) - ref[i]));
    scale = std::max(scale, std::abs(double(ref[i])));
  }
  EXPECT_LE(worst / scale, 1e-4);
  if (world->rank() == 0) {
    const auto a = read_metrics(single.path()), b = read_metrics(dir / "run");
    ASSERT_EQ(metric(b, "loss").size(), static_cast<std::size_t>(kSteps));
    EXPECT_LE(max_rel(metric(b, "loss"), metric(a, "loss")), 1e-5);
    EXPECT_LE(max_rel(metric(b, "grad_norm"), metric(a, "grad_norm")), 1e-4);
    EXPECT_LE(max_rel(metric(b, "test_loss"), metric(a, "test_loss")), 1e-5);
    EXPECT_EQ(metric(b, "test_loss").size(), metric(a, "test_loss").size());
  }
  // The collective checkpoint holds the whole model as every rank holds it.
  LoadedClassifier m = load_classifier(dir / "run");
  EXPECT_EQ(m.step, kSteps);
  ASSERT_EQ(m.params.size(), got.size());
  int64_t differ = 0;
  for (std::size_t i = 0; i < got.size(); ++i) differ += m.params[i] != got[i];
  EXPECT_EQ(differ, 0);
}
