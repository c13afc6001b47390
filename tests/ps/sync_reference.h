// Test support for failure tests of real processes: one undisturbed sync run (2 servers, 2
// workers, kSteps clocks) per test suite, and a check that a disturbed run ends with bitwise its
// parameters. A suite derives from SyncReference.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "ps/process.h"  // tests/ps/process.h
#include "support/temp_dir.h"
#include "train/trainer.h"

namespace moetrain::testing {

inline constexpr int kSteps = 120;

class SyncReference : public ::testing::Test {
 protected:
  // One undisturbed sync run (2 servers, 2 workers) for every test of the suite.
  static void SetUpTestSuite() {
    tmp_ = new TempDir("ps_sync_reference");
    Cluster ref(tmp_->path(), "ref", 2, kSteps, 2, {"--servers", "2"}, "2");
    // A failure here must fail every test: gtest would report a failed suite set-up as skipped
    // tests, which ctest counts as passing.
    if (const int code = ref.scheduler->wait(150); code != 0) {
      reference_error_ =
          "the reference job's scheduler exited " + std::to_string(code) + ":\n" + ref.logs();
      return;
    }
    reference_ = new std::vector<float>(load_model(ref.run).params);
  }
  void SetUp() override { ASSERT_TRUE(reference_error_.empty()) << reference_error_; }
  static void TearDownTestSuite() {
    delete reference_;
    delete tmp_;
  }
  static void expect_reference_params(const std::filesystem::path& run) {
    LoadedModel m = load_model(run);
    EXPECT_EQ(m.step, kSteps);
    ASSERT_EQ(m.params.size(), reference_->size());
    int64_t differ = 0;
    double worst = 0;
    for (std::size_t i = 0; i < m.params.size(); ++i) {
      differ += m.params[i] != (*reference_)[i];
      worst = std::max(worst, std::fabs(static_cast<double>(m.params[i]) - (*reference_)[i]));
    }
    EXPECT_EQ(differ, 0) << "parameters differ from the undisturbed run's (largest difference "
                         << worst << ")";
  }
  static inline TempDir* tmp_ = nullptr;
  static inline std::vector<float>* reference_ = nullptr;
  static inline std::string reference_error_;
};

}  // namespace moetrain::testing
