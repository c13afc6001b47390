// The up-front memory check: a config that cannot fit is refused within moments with both
// figures; the small configs pass; the estimate grows as the model does.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "ft/ft_support.h"
#include "support/temp_dir.h"
#include "train/memory_estimate.h"

namespace moetrain::testing {
namespace {

TEST(MemoryEstimate, CountsParametersOptimizerAndActivations) {
  ModelConfig m;
  const MemoryEstimate e = estimate_memory(m, 16, 128, 0);
  EXPECT_GT(e.parameters, 0);
  EXPECT_EQ(e.gradients, e.parameters);
  EXPECT_EQ(e.optimizer, 2 * e.parameters);
  EXPECT_EQ(e.low_precision, 0);
  EXPECT_GT(e.activations, 0);
  EXPECT_EQ(estimate_memory(m, 16, 128, 2).low_precision, e.parameters / 2);
  ModelConfig twice = m;
  twice.n_layers *= 2;
  EXPECT_GT(estimate_memory(twice, 16, 128, 0).total(), 1.5 * e.total() - e.parameters);
  EXPECT_GT(available_memory(), 0);
}

TEST(MemoryEstimate, AConfigThatCannotFitIsRefusedAtOnce) {
  TempDir tmp("memory_estimate");
  const std::string cfg = write_tiny_run(tmp.path(), 2, 0).string();
  for (const std::string& set :
       {std::string("model.n_layers=1000000"), std::string("model.dim=65536")}) {
    const auto start = std::chrono::steady_clock::now();
    ProcessResult r = run_moetrain(
        {"train", "-c", cfg, "--set", "train.run_dir=" + (tmp / "run").string(), "--set", set},
        {{"OMP_NUM_THREADS", "1"}}, 60);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(r.code, 0) << set << "\n" << r.output();
    EXPECT_LT(s, 2.0) << set << "\n" << r.output();
    EXPECT_NE(r.output().find("needs about"), std::string::npos) << r.output();
    EXPECT_NE(r.output().find(" available ("), std::string::npos) << r.output();
  }
  ProcessResult ok =
      run_moetrain({"train", "-c", cfg, "--set", "train.run_dir=" + (tmp / "ok").string()},
                   {{"OMP_NUM_THREADS", "1"}}, 60);
  EXPECT_EQ(ok.code, 0) << ok.output();
}

}  // namespace
}  // namespace moetrain::testing
