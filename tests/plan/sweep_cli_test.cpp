// `moetrain plan --sweep` through the binary: the layouts it crosses, the one it names best, the
// ones it cannot run (listed with the reason, the rest still predicted), and --procs defaulting
// to the cluster's devices. The 1024-A100 config of the design's ablation (64 experts, 128 nodes
// of 8) is the cluster where the questions are real: how wide an EP group, flat or hierarchical.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "support/plan_runs.h"

using namespace moetrain::testing;

namespace {

const std::string kConfig = plan_file("ablation_moe_1024.toml");
const std::string kCluster = plan_file("a100_1024.toml");

ProcessResult plan(const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"plan", "-c", kConfig, "--cluster", kCluster};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_moetrain(args, {{"OMP_NUM_THREADS", "1"}}, 60);
}

}  // namespace

TEST(PlanSweep, CrossesEpAndAllToAllAndNamesTheFittingLayoutOfMostTokens) {
  const ProcessResult r =
      plan({"--sweep", "ep=8,16,32,3", "--sweep", "a2a=flat,hierarchical", "--json"});
  ASSERT_EQ(r.code, 0) << r.output();
  const nlohmann::json j = json_of(r);
  const auto& layouts = j["layouts"];
  ASSERT_EQ(layouts.size(), 6u) << j.dump(2);  // ep 3 does not divide 1024 processes
  ASSERT_EQ(j["skipped"].size(), 2u) << j.dump(2);
  for (const auto& s : j["skipped"]) {
    EXPECT_EQ(s["ep"], 3);
    EXPECT_NE(s["why"].get<std::string>().find("dist.ep = 3 must divide the processes (1024)"),
              std::string::npos)
        << s.dump();
  }
  // Every layout ran on all 1024 devices (--procs defaults to the cluster's), in the order
  // asked: ep outer, then flat before hierarchical.
  const int64_t eps[] = {8, 8, 16, 16, 32, 32};
  double most = 0;
  for (size_t i = 0; i < layouts.size(); ++i) {
    EXPECT_EQ(layouts[i]["procs"], 1024);
    EXPECT_EQ(layouts[i]["ep"], eps[i]);
    EXPECT_EQ(layouts[i]["a2a_hierarchical_asked"].get<bool>(), i % 2 == 1);
    if (layouts[i]["memory"]["fits"].get<bool>())
      most = std::max(most, layouts[i]["tokens_per_s"].get<double>());
  }
  // An EP group of 8 stays in its node (flat either way); wider groups cross nodes, where the
  // hierarchical exchange is a different schedule with a different time.
  EXPECT_EQ(layouts[1]["a2a_kind"], "flat");
  EXPECT_EQ(layouts[0]["step_time_s"], layouts[1]["step_time_s"]);
  EXPECT_EQ(layouts[3]["a2a_kind"], "hierarchical");
  EXPECT_NE(layouts[2]["step_time_s"], layouts[3]["step_time_s"]);
  ASSERT_EQ(j["best"].size(), 1u) << j.dump(2);
  EXPECT_EQ(j["best"][0]["tokens_per_s"].get<double>(), most);
  EXPECT_EQ(j["best_ep"], j["best"][0]["ep"]);
}

TEST(PlanSweep, TableListsSkippedLayoutsAndTheBestPerProcessCount) {
  const ProcessResult r = plan({"--sweep", "procs=256,1024", "--sweep", "ep=16,512"});
  ASSERT_EQ(r.code, 0) << r.output();
  const std::string out = r.output();
  EXPECT_NE(out.find("256/16/16"), std::string::npos) << out;
  EXPECT_NE(out.find("1024/16/64"), std::string::npos) << out;
  EXPECT_NE(out.find("per device"), std::string::npos) << out;
  EXPECT_NE(out.find("skipped procs=256 ep=512: dist.ep = 512 must divide the processes (256)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("skipped procs=1024 ep=512: dist.ep = 512 must divide model.n_experts = 64"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("best at 256 processes: procs=256 ep=16 ("), std::string::npos) << out;
  EXPECT_NE(out.find("best at 1024 processes: procs=1024 ep=16 ("), std::string::npos) << out;
}

TEST(PlanSweep, BadSweepsAreRefusedNamingTheValue) {
  const ProcessResult key = plan({"--sweep", "batch=1,2"});
  EXPECT_NE(key.code, 0);
  EXPECT_NE(key.output().find("--sweep batch=1,2: expected procs=P1,P2,..., tp=…, pp=…, "
                              "ep=E1,E2,..., etp=… or a2a=flat,hierarchical"),
            std::string::npos)
      << key.output();
  const ProcessResult kind = plan({"--sweep", "a2a=flat,ring"});
  EXPECT_NE(kind.code, 0);
  EXPECT_NE(kind.output().find("--sweep a2a=flat,ring: 'ring' is not flat or hierarchical"),
            std::string::npos)
      << kind.output();
  const ProcessResult twice = plan({"--sweep", "ep=8", "--sweep", "ep=16"});
  EXPECT_NE(twice.code, 0);
  EXPECT_NE(twice.output().find("--sweep ep=16: ep is swept twice"), std::string::npos)
      << twice.output();
  // No layout can run: each is listed with its reason, and nothing else is printed.
  const ProcessResult none = plan({"--sweep", "ep=3,5"});
  EXPECT_NE(none.code, 0);
  const std::string out = none.output();
  EXPECT_NE(out.find("no layout of the sweep can run:"), std::string::npos) << out;
  EXPECT_NE(out.find("ep=3: dist.ep = 3 must divide the processes (1024)"), std::string::npos)
      << out;
  EXPECT_NE(out.find("ep=5: dist.ep = 5 must divide the processes (1024)"), std::string::npos)
      << out;
  EXPECT_EQ(out.find("step time ms"), std::string::npos) << out;
}

// Pipeline stages change how many tokens a step takes (fewer data-parallel ranks), so the best
// layout is the one of most tokens a second that fits, not the shortest step.
TEST(PlanSweep, PipelineSplitsCompareByTokensPerSecond) {
  const std::string cfg =
      std::string(MOETRAIN_SOURCE_DIR) + "/configs/plan/mixtral_8x7b_megatron.toml";
  const std::string cluster =
      std::string(MOETRAIN_SOURCE_DIR) + "/configs/plan/dgx_h100_8nodes.toml";
  const ProcessResult r = run_moetrain(
      {"plan", "-c", cfg, "--cluster", cluster, "--sweep", "pp=1,2,4", "--sweep", "ep=8", "--zero",
       "2", "--json"},
      {{"OMP_NUM_THREADS", "1"}}, 60);
  ASSERT_EQ(r.code, 0) << r.output();
  const nlohmann::json j = json_of(r);
  const auto& layouts = j["layouts"];
  ASSERT_EQ(layouts.size(), 3u) << j.dump(2);
  size_t most = layouts.size();
  for (size_t i = 0; i < layouts.size(); ++i) {
    EXPECT_EQ(layouts[i]["pp"], int64_t{1} << i);
    if (layouts[i]["memory"]["fits"].get<bool>() &&
        (most == layouts.size() ||
         layouts[i]["tokens_per_s"].get<double>() > layouts[most]["tokens_per_s"].get<double>()))
      most = i;
  }
  ASSERT_LT(most, layouts.size()) << j.dump(2);
  // The shortest step is not the answer here: more stages, fewer tokens a step.
  EXPECT_LT(layouts[2]["step_time_s"].get<double>(), layouts[most]["step_time_s"].get<double>())
      << j.dump(2);
  ASSERT_EQ(j["best"].size(), 1u) << j.dump(2);
  EXPECT_EQ(j["best"][0]["pp"], layouts[most]["pp"]);
  EXPECT_EQ(j["best"][0]["tokens_per_s"], layouts[most]["tokens_per_s"]);
  // The trainer's pipelines run expert parallelism and ZeRO-1 and 2 inside their stages: these
  // (EP 8, ZeRO-2) all run.
  for (size_t i = 0; i < layouts.size(); ++i)
    EXPECT_TRUE(layouts[i]["trainer_runs"].get<bool>()) << j.dump(2);
  EXPECT_TRUE(j["best"][0]["trainer_runs"].get<bool>()) << j.dump(2);
  // int8 gradients in stages do not: the best line says what the trainer refuses, by its key.
  const ProcessResult table = run_moetrain(
      {"plan", "-c", cfg, "--cluster", cluster, "--sweep", "pp=2,4", "--sweep", "ep=8", "--zero",
       "1", "--set", "dist.grad_reduce_dtype=int8"},
      {{"OMP_NUM_THREADS", "1"}}, 60);
  ASSERT_EQ(table.code, 0) << table.output();
  EXPECT_NE(table.output().find("planner only: dist.pp = 2 with dist.grad_reduce_dtype = int8 "
                                "(its error-feedback residual in checkpoints): the pipeline "
                                "executor does not run it yet"),
            std::string::npos)
      << table.output();
  EXPECT_EQ(table.count("trainer runs it"), 1) << table.output();
}

// No layout fits the device: every layout is still printed (JSON too, with fits = false), then
// the command fails naming what the smallest one needs.
TEST(PlanSweep, NothingFitsStillPrintsEveryLayout) {
  const std::string cfg = plan_file("mixtral_8x7b_megatron.toml");
  const std::string cluster = plan_file("dgx_h100_8nodes.toml");
  const ProcessResult r = run_moetrain(
      {"plan", "-c", cfg, "--cluster", cluster, "--sweep", "ep=1,2", "--json"},
      {{"OMP_NUM_THREADS", "1"}}, 60);
  EXPECT_NE(r.code, 0) << r.output();
  const nlohmann::json j = json_of(r);
  ASSERT_EQ(j["layouts"].size(), 2u) << j.dump(2);
  for (const auto& l : j["layouts"]) EXPECT_FALSE(l["memory"]["fits"].get<bool>()) << j.dump(2);
  EXPECT_TRUE(j["best"].empty()) << j.dump(2);
  EXPECT_NE(r.output().find("the model does not fit: it needs "), std::string::npos)
      << r.output();
  const ProcessResult table = run_moetrain(
      {"plan", "-c", cfg, "--cluster", cluster, "--sweep", "ep=1,2"}, {{"OMP_NUM_THREADS", "1"}},
      60);
  EXPECT_NE(table.code, 0) << table.output();
  EXPECT_NE(table.output().find("best: none fits the device's memory"), std::string::npos)
      << table.output();
}

// More layouts than fit side by side: a line each, with the all-to-all the layout ran.
TEST(PlanSweep, WideSweepsPrintALineALayout) {
  const ProcessResult r = plan({"--sweep", "ep=8,16,32,64", "--sweep", "a2a=flat,hierarchical"});
  ASSERT_EQ(r.code, 0) << r.output();
  const std::string out = r.output();
  EXPECT_NE(out.find("GiB/device"), std::string::npos) << out;
  EXPECT_EQ(out.find("step time ms"), std::string::npos) << out;  // not the wide table
  auto lines_starting = [&](const std::string& label) {
    int n = 0;
    for (const auto& l : r.lines) n += l.text.rfind(label + " ", 0) == 0;
    return n;
  };
  for (const char* layout :
       {"ep=8 a2a=flat", "ep=8 a2a=hierarchical", "ep=16 a2a=hierarchical", "ep=64 a2a=flat"})
    EXPECT_EQ(lines_starting(layout), 1) << layout << "\n" << out;
  // An EP group of 8 is one node: flat whatever was asked; 16 crosses nodes.
  for (const auto& l : r.lines) {
    if (l.text.rfind("ep=8 a2a=hierarchical", 0) == 0) {
      EXPECT_NE(l.text.find(" flat "), std::string::npos) << l.text;
    }
    if (l.text.rfind("ep=16 a2a=hierarchical", 0) == 0) {
      EXPECT_NE(l.text.find(" hierarchical "), std::string::npos) << l.text;
    }
  }
  EXPECT_NE(out.find("best: ep="), std::string::npos) << out;
}

// Expert tensor parallelism is a sweep dimension: each value a layout, the ones whose EP × ETP do
// not divide the processes named with the reason; the single plan writes its collectives out.
TEST(PlanSweep, ExpertTensorParallelIsSweptAndWrittenOut) {
  const ProcessResult r = plan({"--ep", "16", "--sweep", "etp=1,2,3", "--json"});
  ASSERT_EQ(r.code, 0) << r.output();
  const nlohmann::json j = json_of(r);
  ASSERT_EQ(j["layouts"].size(), 2u) << j.dump(2);
  EXPECT_EQ(j["layouts"][0]["etp"], 1);
  EXPECT_EQ(j["layouts"][1]["etp"], 2);
  EXPECT_EQ(j["layouts"][0]["comm"]["expert_tensor_parallel"]["per_step"], 0);
  EXPECT_GT(j["layouts"][1]["comm"]["expert_tensor_parallel"]["per_step"].get<double>(), 0);
  // Half of each expert a rank: its expert parameters halve.
  EXPECT_LT(j["layouts"][1]["memory"]["params_bytes"].get<double>(),
            j["layouts"][0]["memory"]["params_bytes"].get<double>());
  ASSERT_EQ(j["skipped"].size(), 1u) << j.dump(2);
  EXPECT_EQ(j["skipped"][0]["etp"], 3);
  EXPECT_NE(j["skipped"][0]["why"].get<std::string>().find("dist.ep = 16 × --etp 3"),
            std::string::npos)
      << j["skipped"][0].dump();
  const ProcessResult one = plan({"--ep", "16", "--etp", "2"});
  ASSERT_EQ(one.code, 0) << one.output();
  EXPECT_NE(one.output().find("expert tensor parallelism: 56 all-gather + reduce-scatter pairs"),
            std::string::npos)
      << one.output();
}
