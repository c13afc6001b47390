// The planner against this machine: calibrate, train a few steps of configs/tiny.toml with one
// process and with two (EP 2, then DP 2) and compare the predicted step time with the median
// measured one (steps after the first). Calibration and training run back to back so that both
// see the same neighbours on a shared machine, and the machine is calibrated again afterwards:
// when the two calibrations predict step times more than 15% apart, the machine's own speed
// moved more than the tolerance during the test and the comparison cannot be judged — the test
// is skipped with the table, rather than passing or failing by chance.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ft/ft_support.h"
#include "io/metrics.h"
#include "support/temp_dir.h"

using namespace moetrain::testing;

namespace {

// Fewer sequences than the demo's 16 keep the test under a minute; the planner is given the
// same override.
const std::vector<std::string> kSets = {"--set", "train.batch_size=8", "--set", "train.steps=4",
                                        "--set", "train.eval_every=0", "--set",
                                        "train.eval_batches=1", "--set", "train.progress=off",
                                        "--set", "train.tensorboard=false"};

double median_step_time(const std::filesystem::path& run_dir) {
  std::vector<double> t;
  for (const auto& line : moetrain::read_metrics(run_dir))
    if (line.contains("step_time_s") && line["step"].get<int64_t>() > 1)
      t.push_back(line["step_time_s"].get<double>());
  if (t.empty()) return -1;
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double predicted_step_time(const std::string& profile, const std::string& config, int procs,
                           int ep) {
  std::vector<std::string> args = {"plan", "-c", config, "--profile", profile, "--procs",
                                   std::to_string(procs), "--ep", std::to_string(ep), "--json"};
  args.insert(args.end(), kSets.begin(), kSets.end());
  const ProcessResult r = run_moetrain(args, {{"OMP_NUM_THREADS", "2"}}, 60);
  EXPECT_EQ(r.code, 0) << r.output();
  std::string text;
  for (const auto& l : r.lines)
    if (!l.text.empty() && (l.text[0] == '{' || l.text[0] == ' ' || l.text[0] == '}'))
      text += l.text + "\n";
  return nlohmann::json::parse(text)["step_time_s"].get<double>();
}

}  // namespace

TEST(PlanValidation, PredictsTinyStepTimeWithin15Percent) {
  TempDir tmp("plan_validation");
  write_corpus(tmp.path() / "data", 60000);
  const std::string config = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const std::string profile = (tmp.path() / "profile.toml").string();
  const ProcessResult cal = run_moetrain({"plan", "--calibrate", "--out", profile},
                                         {{"OMP_NUM_THREADS", "2"}}, 60);
  ASSERT_EQ(cal.code, 0) << cal.output();
  std::cout << cal.output();

  struct Case {
    const char* name;
    int procs, ep;
  };
  std::string table = "layout        measured ms  predicted ms  error\n";
  double worst = 0;
  for (const Case c : {Case{"1 process", 1, 1}, Case{"2 procs EP=2", 2, 2},
                       Case{"2 procs DP=2", 2, 1}}) {
    const auto run_dir = tmp.path() / ("run_" + std::to_string(c.procs) + std::to_string(c.ep));
    std::vector<std::string> train = {"train", "-c", config, "--set",
                                      "data.dir=" + (tmp.path() / "data").string(), "--set",
                                      "train.run_dir=" + run_dir.string()};
    train.insert(train.end(), kSets.begin(), kSets.end());
    std::vector<std::string> args = train;
    auto env = mpi_env();
    if (c.procs == 1) {
      env = {{"OMP_NUM_THREADS", "2"}};
    } else {
      args = {"launch", "-n", std::to_string(c.procs), "--"};
      args.insert(args.end(), train.begin(), train.end());
      args.insert(args.end(), {"--ep", std::to_string(c.ep)});
    }
    const ProcessResult r = run_moetrain(args, env, 120);
    ASSERT_EQ(r.code, 0) << r.output();
    const double measured = median_step_time(run_dir);
    ASSERT_GT(measured, 0) << "no step_time_s in " << run_dir;
    const double predicted = predicted_step_time(profile, config, c.procs, c.ep);
    const double err = (predicted - measured) / measured;
    worst = std::max(worst, std::fabs(err));
    table += fmt::format("{:<13} {:>11.1f} {:>13.1f} {:>+6.0f}%\n", c.name, measured * 1e3,
                         predicted * 1e3, err * 100);
  }
  std::cout << table;
  const std::string after = (tmp.path() / "profile_after.toml").string();
  const ProcessResult cal2 = run_moetrain({"plan", "--calibrate", "--out", after},
                                          {{"OMP_NUM_THREADS", "2"}}, 60);
  ASSERT_EQ(cal2.code, 0) << cal2.output();
  double drift = 0;
  for (const auto& [procs, ep] : {std::pair{1, 1}, std::pair{2, 2}}) {
    const double a = predicted_step_time(profile, config, procs, ep);
    const double b = predicted_step_time(after, config, procs, ep);
    drift = std::max(drift, std::fabs(b - a) / a);
  }
  if (drift > 0.15)
    GTEST_SKIP() << fmt::format(
        "this machine's speed moved {:.0f}% between the calibrations before and after the "
        "runs (shared, noisy): a 15% check cannot be judged\n{}",
        drift * 100, table);
  EXPECT_LT(worst, 0.15) << table;
}
