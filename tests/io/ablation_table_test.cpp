// The ablation table from hand-made run directories: which steps count, how each figure is
// reduced, the medians over a row's runs and the ratios to the baseline row.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <string>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/ablation_table.h"
#include "support/temp_dir.h"

using namespace moetrain;
using moetrain::testing::TempDir;

namespace {

// One run of two processes: a warm-up step that the figures must leave out (slow, all tokens on
// one expert), two timed steps, then the final evaluation. seq_len 10: a step of tokens_per_s · dt
// = 40 tokens is 4 sequences. A timed step computes 0.75·dt and communicates 0.5·dt in all.
void write_run(const TempDir& tmp, const std::string& dir, double dt, double efficiency,
               double val_loss) {
  tmp.write(dir + "/run_config.json", R"({"train": {"seq_len": 10}})");
  std::string lines =
      fmt::format(R"({{"step":1,"step_time_s":100,"tokens_per_s":0.01,"comm_efficiency":0,)"
                  R"("compute_s":1,"comm_total_s":99,"tokens_per_expert":[[8,0,0],[8,0,0]]}})"
                  "\n");
  for (int step = 2; step <= 3; ++step)
    lines += fmt::format(R"({{"step":{},"step_time_s":{},"tokens_per_s":{},"comm_efficiency":{},)"
                         R"("compute_s":{},"comm_total_s":{},"rank_step_time_s":[{},{}],)"
                         R"("dropped_fraction":[0.5,0.0],"tokens_per_expert":[[3,1,0],[2,2,2]]}})"
                         "\n",
                         step, dt, 40 / dt, efficiency, 0.75 * dt, 0.5 * dt, dt, dt);
  lines += R"({"step":2,"val_loss":9.0})"
           "\n";  // an earlier evaluation
  lines += fmt::format(R"({{"step":3,"val_loss":{}}})"
                       "\n",
                       val_loss);
  tmp.write(dir + "/metrics.jsonl", lines);
}

}  // namespace

TEST(AblationTable, RunFiguresSkipTheWarmUp) {
  TempDir tmp("ablation");
  write_run(tmp, "run", 0.5, 0.8, 2.5);
  const AblationFigures f = ablation_run_figures(tmp / "run", 1);
  // Active experts: 2 of 3 in layer 0, 3 of 3 in layer 1, in each timed step.
  EXPECT_DOUBLE_EQ(f.utilisation, (2.0 / 3.0 + 1.0) / 2);
  // Layer 0: loads 6, 2, 0 (mean 8/3, max 6); layer 1: 4, 4, 4 (mean = max).
  EXPECT_DOUBLE_EQ(f.load_balance, (8.0 / 3.0 / 6.0 + 1.0) / 2);
  EXPECT_DOUBLE_EQ(f.comm_efficiency, 0.75 / (0.75 + 0.5));
  EXPECT_DOUBLE_EQ(f.comm_efficiency_exposed, 0.8);
  EXPECT_DOUBLE_EQ(f.samples_per_s, 8.0 / 1.0);  // 2 × 4 sequences in 2 × 0.5 s
  EXPECT_DOUBLE_EQ(f.kept_samples_per_s, 8.0 * 0.75);  // a quarter of the assignments dropped
  EXPECT_DOUBLE_EQ(f.val_loss, 2.5);
  EXPECT_DOUBLE_EQ(f.training_efficiency, 8.0 * f.utilisation / 2);  // two processes
  // Counting the warm-up step changes every timed figure.
  const AblationFigures all = ablation_run_figures(tmp / "run", 0);
  EXPECT_LT(all.samples_per_s, 1.0);
  EXPECT_LT(all.utilisation, f.utilisation);
  EXPECT_LT(all.load_balance, f.load_balance);
  EXPECT_LT(all.comm_efficiency, f.comm_efficiency);
}

TEST(AblationTable, MediansOverRunsAndRatiosToTheBaseline) {
  TempDir tmp("ablation");
  tmp.write("setup.txt", "Setup: mode **netns**\n");
  // Baseline step times 0.5, 1, 4 (median 1: 4 samples/s); the faster row 0.25, 0.5, 0.5.
  write_run(tmp, "runs/1_baseline/1", 0.5, 0.6, 2.0);
  write_run(tmp, "runs/1_baseline/2", 1.0, 0.5, 3.0);
  write_run(tmp, "runs/1_baseline/3", 4.0, 0.9, 2.5);
  write_run(tmp, "runs/2_faster/1", 0.25, 0.75, 2.75);
  write_run(tmp, "runs/2_faster/2", 0.5, 0.9, 2.5);
  write_run(tmp, "runs/2_faster/3", 0.5, 0.8, 5.0);
  const AblationTable t = read_ablation(tmp.path(), 1);
  ASSERT_EQ(t.rows.size(), 2u);
  EXPECT_EQ(t.setup, "Setup: mode **netns**");
  EXPECT_EQ(t.rows[0].name, "1_baseline");
  EXPECT_EQ(t.rows[1].runs.size(), 3u);
  EXPECT_DOUBLE_EQ(t.rows[0].median.samples_per_s, 4.0);
  EXPECT_DOUBLE_EQ(t.rows[0].median.comm_efficiency_exposed, 0.6);
  EXPECT_DOUBLE_EQ(t.rows[0].median.val_loss, 2.5);
  EXPECT_DOUBLE_EQ(t.rows[1].median.samples_per_s, 8.0);
  EXPECT_DOUBLE_EQ(t.rows[1].relative.samples_per_s, 2.0);
  EXPECT_DOUBLE_EQ(t.rows[1].relative.comm_efficiency_exposed, 0.8 / 0.6);
  EXPECT_DOUBLE_EQ(t.rows[1].relative.training_efficiency, 2.0);
  EXPECT_DOUBLE_EQ(t.rows[1].relative.val_loss, 2.75 / 2.5);
  EXPECT_DOUBLE_EQ(t.rows[0].relative.utilisation, 1.0);

  const std::string md = ablation_markdown(t);
  EXPECT_NE(md.find("Setup: mode **netns**"), std::string::npos) << md;
  EXPECT_NE(md.find("| 2_faster | 3 |"), std::string::npos) << md;
  EXPECT_NE(md.find("8.00 (×2.00)"), std::string::npos) << md;
  EXPECT_EQ(ablation_json(t)["rows"][1]["relative"]["samples_per_s"], 2.0);
  const std::string svg = ablation_svg(t);
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("<style>"), std::string::npos);
  EXPECT_NE(svg.find("samples/s"), std::string::npos);

  write_ablation(tmp.path(), 1);
  EXPECT_TRUE(std::filesystem::exists(tmp / "table.md"));
  EXPECT_TRUE(std::filesystem::exists(tmp / "table.json"));
  EXPECT_TRUE(std::filesystem::exists(tmp / "ablation.svg"));
}

TEST(AblationTable, AnUnfinishedRunOrAMissingFolderIsNamed) {
  TempDir tmp("ablation");
  EXPECT_THROW(read_ablation(tmp.path(), 1), Error);
  tmp.write("runs/1_baseline/1/config.json", R"({"train": {"seq_len": 10}})");
  tmp.write("runs/1_baseline/1/metrics.jsonl",
            R"({"step":2,"step_time_s":1,"tokens_per_s":10,"compute_s":1,"comm_total_s":0,)"
            R"("tokens_per_expert":[[1,1]]})"
            "\n");
  try {
    read_ablation(tmp.path(), 1);
    FAIL() << "a run without its final evaluation was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no val_loss"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("1_baseline/1/metrics.jsonl"), std::string::npos)
        << e.what();
  }
  try {
    ablation_run_figures(tmp / "runs/1_baseline/1", 5);
    FAIL() << "a run with only warm-up steps was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no timed step"), std::string::npos) << e.what();
  }
}
