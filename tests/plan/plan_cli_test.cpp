// `moetrain plan` through the binary: bad input refused with a clear message naming the key and a
// non-zero exit; a model that does not fit with the memory per device it needs; a model of a
// million experts planned in moments.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "support/plan_runs.h"
#include "support/temp_dir.h"

using namespace moetrain::testing;

namespace {

ProcessResult plan(const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"plan"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_moetrain(args, {{"OMP_NUM_THREADS", "1"}}, 60);
}

}  // namespace

TEST(PlanCli, ClusterFileWithAMissingKeyIsNamed) {
  TempDir tmp("plan_cli");
  const std::string cluster = (tmp.path() / "cluster.toml").string();
  std::ofstream(cluster) << "[cluster]\ndevice = \"h100\"\ndevices_per_node = 8\nnodes = 8\n"
                            "intra_node_bandwidth = 450e9\ninter_node_bandwidth = 400e9\n"
                            "intra_node_latency = 3e-6\n";
  const ProcessResult r = plan({"-c", plan_file("mixtral_8x7b_megatron.toml"), "--cluster", cluster,
                                "--procs", "64", "--pp", "4", "--vp", "8"});
  EXPECT_NE(r.code, 0) << r.output();
  EXPECT_NE(r.output().find("cluster.inter_node_latency is missing"), std::string::npos)
      << r.output();
  std::ofstream(cluster, std::ios::app) << "inter_node_latency = 0\n";
  const ProcessResult z = plan({"-c", plan_file("mixtral_8x7b_megatron.toml"), "--cluster", cluster,
                                "--procs", "64", "--pp", "4", "--vp", "8"});
  EXPECT_NE(z.code, 0) << z.output();
  EXPECT_NE(z.output().find("cluster.inter_node_latency = 0: must be positive"), std::string::npos)
      << z.output();
}

TEST(PlanCli, LayoutThatDoesNotDivideIsRefused) {
  const std::string cfg = plan_file("mixtral_8x7b_megatron.toml");
  const std::string cluster = plan_file("dgx_h100_8nodes.toml");
  const ProcessResult ep = plan({"-c", cfg, "--cluster", cluster, "--procs", "12", "--ep", "8"});
  EXPECT_NE(ep.code, 0) << ep.output();
  EXPECT_NE(ep.output().find("dist.ep = 8 must divide the processes (12)"), std::string::npos)
      << ep.output();
  const ProcessResult pp =
      plan({"-c", cfg, "--cluster", cluster, "--procs", "48", "--pp", "3", "--ep", "8"});
  EXPECT_NE(pp.code, 0) << pp.output();
  EXPECT_NE(pp.output().find("model.n_layers = 32 must be divisible by --pp 3"), std::string::npos)
      << pp.output();
  const ProcessResult sched = plan({"-c", cfg, "--cluster", cluster, "--procs", "64", "--pp", "4",
                                    "--ep", "8", "--pp-schedule", "zb"});
  EXPECT_NE(sched.code, 0) << sched.output();
  EXPECT_NE(sched.output().find("--pp-schedule = 'zb': allowed are gpipe, 1f1b, interleaved, "
                                "zero_bubble"),
            std::string::npos)
      << sched.output();
  const ProcessResult vp = plan({"-c", cfg, "--cluster", cluster, "--procs", "64", "--pp", "4",
                                 "--vp", "2", "--ep", "8", "--pp-schedule", "1f1b"});
  EXPECT_NE(vp.code, 0) << vp.output();
  EXPECT_NE(vp.output().find("2 virtual stages (vp) with the 1f1b schedule"), std::string::npos)
      << vp.output();
  const ProcessResult zb = plan({"-c", cfg, "--cluster", cluster, "--procs", "64", "--pp", "4",
                                 "--ep", "8", "--pp-schedule", "zero_bubble", "--json"});
  EXPECT_EQ(zb.code, 0) << zb.output();
  EXPECT_NE(zb.output().find("\"zero_bubble\""), std::string::npos) << zb.output();
  const ProcessResult many = plan({"-c", cfg, "--cluster", cluster, "--procs", "128"});
  EXPECT_NE(many.code, 0) << many.output();
  EXPECT_NE(many.output().find("128 processes but the cluster has 64 devices"), std::string::npos)
      << many.output();
}

// Mixtral 8×7B without pipeline stages or expert parallelism: every process holds all 32
// layers and all 8 experts, bf16 weights and f32 gradients: far over 80 GB. The figures are
// still printed (they are what a user shrinks the run by), in GiB, and the command fails saying
// by how much it is over.
TEST(PlanCli, ModelThatDoesNotFitPrintsItsFiguresAndSaysByHowMuch) {
  const std::vector<std::string> args = {"-c", plan_file("mixtral_8x7b_megatron.toml"),
                                         "--cluster", plan_file("dgx_h100_8nodes.toml"),
                                         "--procs", "64", "--ep", "1"};
  const ProcessResult r = plan(args);
  EXPECT_NE(r.code, 0) << r.output();
  const std::string out = r.output();
  EXPECT_NE(out.find("the model does not fit: it needs "), std::string::npos) << out;
  EXPECT_NE(out.find("GiB per device"), std::string::npos) << out;
  EXPECT_NE(out.find("device.memory_bytes): "), std::string::npos) << out;
  EXPECT_NE(out.find(" GiB too much"), std::string::npos) << out;
  EXPECT_NE(out.find("step time ms"), std::string::npos) << out;
  EXPECT_NE(out.find("memory GiB/device"), std::string::npos) << out;
  EXPECT_EQ(out.find("MiB"), std::string::npos) << out;
  std::vector<std::string> json_args = args;
  json_args.push_back("--json");
  const ProcessResult j = plan(json_args);
  EXPECT_NE(j.code, 0) << j.output();
  const nlohmann::json doc = json_of(j);
  EXPECT_FALSE(doc["memory"]["fits"].get<bool>()) << doc.dump(2);
  EXPECT_GT(doc["step_time_s"].get<double>(), 0) << doc.dump(2);
  EXPECT_NE(j.output().find(" GiB too much"), std::string::npos) << j.output();
}

// Selective recomputation through the binary: the table names the modules and that the trainer
// does not run them, the JSON carries them, a sweep's best layout says it is the planner's only;
// an unknown module and a combination with full recomputation are refused by name.
TEST(PlanCli, SelectiveRecomputationIsNamedAndChecked) {
  const std::vector<std::string> base = {"-c", plan_file("mixtral_8x7b_megatron.toml"),
                                         "--cluster", plan_file("dgx_h100_8nodes.toml"),
                                         "--procs", "64", "--pp", "4", "--vp", "8"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return plan(args);
  };
  const ProcessResult t = with({"--recompute-modules", "layernorm,moe_act"});
  ASSERT_EQ(t.code, 0) << t.output();
  EXPECT_NE(t.output().find("recomputed modules        layernorm,moe_act"), std::string::npos)
      << t.output();
  EXPECT_NE(t.output().find("trainer runs it                       no"), std::string::npos)
      << t.output();
  const ProcessResult j = with({"--recompute-modules", "moe_act", "--json"});
  ASSERT_EQ(j.code, 0) << j.output();
  const nlohmann::json doc = json_of(j);
  EXPECT_EQ(doc["recompute_modules"], "moe_act") << doc.dump(2);
  EXPECT_FALSE(doc["trainer_runs"].get<bool>()) << doc.dump(2);
  const ProcessResult sw = with({"--recompute-modules", "layernorm", "--sweep", "ep=4,8"});
  ASSERT_EQ(sw.code, 0) << sw.output();
  EXPECT_NE(sw.output().find("planner only: moetrain train has no selective recomputation "
                             "(layernorm) yet"),
            std::string::npos)
      << sw.output();
  const ProcessResult bad = with({"--recompute-modules", "layernorm,core_attn"});
  EXPECT_NE(bad.code, 0) << bad.output();
  EXPECT_NE(bad.output().find("--recompute-modules layernorm,core_attn: 'core_attn' is not a "
                              "module; allowed are layernorm, moe_act"),
            std::string::npos)
      << bad.output();
  const ProcessResult full = with({"--recompute-modules", "layernorm", "--recompute"});
  EXPECT_NE(full.code, 0) << full.output();
  EXPECT_NE(full.output().find("--recompute-modules layernorm with recomputation full"),
            std::string::npos)
      << full.output();
}

// Whole-number keys are range-checked before they become integers (1e30 overflows int64), and
// a directory given as the cluster file is named as one.
TEST(PlanCli, ClusterFileOutOfRangeOrADirectoryIsNamed) {
  TempDir tmp("plan_cli_range");
  const std::string cluster = (tmp.path() / "cluster.toml").string();
  auto write = [&](const std::string& per_node, const std::string& nodes) {
    std::ofstream(cluster) << "[cluster]\ndevice = \"h100\"\ndevices_per_node = " << per_node
                           << "\nnodes = " << nodes
                           << "\nintra_node_bandwidth = 450e9\ninter_node_bandwidth = 400e9\n"
                              "intra_node_latency = 3e-6\ninter_node_latency = 10e-6\n";
  };
  const std::vector<std::string> args = {"-c", plan_file("mixtral_8x7b_megatron.toml"),
                                         "--cluster", cluster, "--procs", "64", "--pp", "4"};
  write("1e30", "8");
  const ProcessResult huge = plan(args);
  EXPECT_NE(huge.code, 0) << huge.output();
  EXPECT_NE(huge.output().find("cluster.devices_per_node = 1e+30: must be a whole number in [1, "
                               "65536]"),
            std::string::npos)
      << huge.output();
  write("8", "2.5");
  const ProcessResult half = plan(args);
  EXPECT_NE(half.code, 0) << half.output();
  EXPECT_NE(half.output().find("cluster.nodes = 2.5: must be a whole number in [1, 16777216]"),
            std::string::npos)
      << half.output();
  write("8", "8");
  EXPECT_EQ(plan(args).code, 0);
  std::vector<std::string> dir = args;
  dir[3] = tmp.path().string();
  const ProcessResult d = plan(dir);
  EXPECT_NE(d.code, 0) << d.output();
  EXPECT_NE(d.output().find("cluster file '" + tmp.path().string() + "' is a directory"),
            std::string::npos)
      << d.output();
  EXPECT_EQ(d.output().find("does not exist"), std::string::npos) << d.output();
}

TEST(PlanCli, CalibrationArgumentsAreChecked) {
  TempDir tmp("plan_cli_calibrate");
  const std::string out = (tmp.path() / "p.toml").string();
  // A process count of one cannot measure a collective; checked before anything is measured.
  const ProcessResult one = plan({"--calibrate", "--comm-procs", "2,1", "--out", out});
  EXPECT_NE(one.code, 0) << one.output();
  EXPECT_NE(one.output().find("--comm-procs 2,1: '1' is not 0 or a whole number ≥ 2"),
            std::string::npos)
      << one.output();
  // The config's keys are checked as for train, naming the key.
  const ProcessResult bad = plan({"--calibrate", "--comm-procs", "0", "-c",
                                  std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml", "--set",
                                  "model.dimm=64", "--out", out});
  EXPECT_NE(bad.code, 0) << bad.output();
  EXPECT_NE(bad.output().find("model.dimm"), std::string::npos) << bad.output();
  EXPECT_FALSE(std::filesystem::exists(out));
}

// As root, mpirun refuses to start the collectives' measurement unless told otherwise: the
// refusal is named with what to pass, and --mpi-arg passes it.
TEST(PlanCli, CalibrateTakesMpiArgsForMpirun) {
  if (::geteuid() != 0) GTEST_SKIP() << "mpirun refuses root only; not root here";
  TempDir tmp("plan_cli_mpi_arg");
  const std::string out = (tmp.path() / "p.toml").string();
  // The real mpirun, without the variables that let it run as root.
  const std::string strict = (tmp.path() / "bin").string();
  std::filesystem::create_directories(strict);
  {
    std::ofstream(strict + "/mpirun")
        << "#!/bin/sh\nexec env -u OMPI_ALLOW_RUN_AS_ROOT -u OMPI_ALLOW_RUN_AS_ROOT_CONFIRM "
           "/usr/bin/mpirun \"$@\"\n";
  }
  std::filesystem::permissions(strict + "/mpirun", std::filesystem::perms::owner_all);
  const std::vector<std::pair<std::string, std::string>> env = {
      {"OMP_NUM_THREADS", "1"}, {"PATH", strict + ":" + std::string(std::getenv("PATH"))}};
  const std::vector<std::string> args = {"plan", "--calibrate", "--no-bf16", "--comm-procs",
                                         "2",    "--out",       out};
  const ProcessResult refused = run_moetrain(args, env, 300);
  EXPECT_NE(refused.code, 0) << refused.output();
  EXPECT_NE(refused.output().find("mpirun refuses to run as root: pass "
                                  "--mpi-arg=--allow-run-as-root"),
            std::string::npos)
      << refused.output();
  std::vector<std::string> allowed = args;
  allowed.push_back("--mpi-arg=--allow-run-as-root");
  const ProcessResult ok = run_moetrain(allowed, env, 300);
  EXPECT_EQ(ok.code, 0) << ok.output();
  EXPECT_NE(ok.output().find("collectives with 2 processes"), std::string::npos) << ok.output();
  EXPECT_TRUE(std::filesystem::exists(out));
}

// --advise: refused without a cluster file or with a bad size, naming the flag; listed in the
// help; the table holds the design's tiers.
TEST(PlanCli, AdviseNeedsAClusterAndWholeSizes) {
  const std::string cfg = plan_file("ablation_moe_1024.toml");
  const std::string cluster = plan_file("a100_1024.toml");
  const ProcessResult none = plan({"-c", cfg, "--advise"});
  EXPECT_NE(none.code, 0) << none.output();
  EXPECT_NE(none.output().find("plan --advise needs --cluster"), std::string::npos)
      << none.output();
  for (const std::string bad : {"0", "8,x", "-8"}) {
    const ProcessResult r = plan({"-c", cfg, "--cluster", cluster, "--advise", "--sizes=" + bad});
    EXPECT_NE(r.code, 0) << r.output();
    EXPECT_NE(r.output().find("--sizes " + bad + ": '"), std::string::npos) << r.output();
  }
  const ProcessResult alone = plan({"-c", cfg, "--cluster", cluster, "--sizes", "8"});
  EXPECT_NE(alone.code, 0) << alone.output();
  EXPECT_NE(alone.output().find("--sizes is for plan --advise"), std::string::npos)
      << alone.output();
  const ProcessResult procs =
      plan({"-c", cfg, "--cluster", cluster, "--advise", "--procs", "64"});
  EXPECT_NE(procs.code, 0) << procs.output();
  EXPECT_NE(procs.output().find("does not take --ablation, --sweep or --procs"), std::string::npos)
      << procs.output();
  const ProcessResult help = plan({"--help"});
  EXPECT_EQ(help.code, 0) << help.output();
  EXPECT_NE(help.output().find("--advise"), std::string::npos) << help.output();
  EXPECT_NE(help.output().find("--sizes"), std::string::npos) << help.output();
  const ProcessResult ok =
      plan({"-c", cfg, "--cluster", cluster, "--advise", "--sizes", "8,4096", "--load", "uniform",
            "--json"});
  ASSERT_EQ(ok.code, 0) << ok.output();
  const nlohmann::json j = json_of(ok)["advice"];
  ASSERT_EQ(j.size(), 2u) << ok.output();
  EXPECT_EQ(j[0]["design_tier"]["name"], "small");
  EXPECT_EQ(j[1]["design_tier"]["name"], "large");
  EXPECT_EQ(j[0]["exchange"]["choice"], "flat");
  EXPECT_EQ(j[1]["exchange"]["choice"], "hierarchical");
}

// A million experts is shape arithmetic, not a per-expert walk: the planner answers in well under
// a second on a 2-core machine (10 s here leaves room for a loaded one) and its memory stays that
// of the binary: under 200 MB whatever the expert count, also where the CUDA backend is built
// (its cuBLAS libraries, about 150 MB resident once loaded, are loaded by a device run only). The
// router alone, replicated on every device, is n_layers × n_experts × dim f32 weights: the
// figures are a million experts' own.
TEST(PlanCli, AMillionExpertsIsPlannedQuickly) {
  struct rusage before {};
  ::getrusage(RUSAGE_CHILDREN, &before);
  const auto start = std::chrono::steady_clock::now();
  const ProcessResult r = plan({"-c", std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml",
                                "--set", "model.n_experts=1000000", "--set", "model.dim=16",
                                "--set", "model.expert_hidden=16", "--cluster",
                                plan_file("dgx_h100_8nodes.toml"), "--procs", "64", "--ep", "64",
                                "--json"});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.code, 0) << r.output();
  EXPECT_LT(seconds, 10.0) << r.output();
  const nlohmann::json doc = json_of(r);
  EXPECT_GT(doc["memory"]["params_bytes"].get<double>(), 4.0 * 1e6 * 16 * 4) << doc.dump(2);
  EXPECT_GT(doc["tokens_per_s"].get<double>(), 0) << doc.dump(2);
  // The largest child so far: this run's when it rose (ctest runs each test alone).
  struct rusage after {};
  ::getrusage(RUSAGE_CHILDREN, &after);
  if (after.ru_maxrss > before.ru_maxrss) {
    EXPECT_LT(after.ru_maxrss, 200'000'000 / 1024) << "KiB (200 MB)";
  }
}

// --pp-trace writes the pipeline the bubble was timed on, as Chrome trace-event JSON: every pass
// of every stage, on one lane a stage. It needs one layout with a pipeline, refused otherwise with
// nothing written.
TEST(PlanCli, PipelineTraceIsTheTimedSchedule) {
  TempDir tmp("plan_pp_trace");
  const std::string trace = (tmp.path() / "pp.json").string();
  const std::vector<std::string> base = {
      "-c", std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml", "--cluster",
      plan_file("dgx_h100_8nodes.toml"), "--procs", "4", "--set", "train.grad_accum=8"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const ProcessResult refused = plan(with({"--pp-trace", trace}));
  EXPECT_NE(refused.code, 0);
  EXPECT_NE(refused.output().find("--pp-trace"), std::string::npos) << refused.output();
  EXPECT_FALSE(std::filesystem::exists(trace));

  const ProcessResult r = plan(with({"--pp", "4", "--pp-schedule", "zero_bubble", "--pp-trace", trace}));
  ASSERT_EQ(r.code, 0) << r.output();
  std::ifstream in(trace);
  const nlohmann::json doc = nlohmann::json::parse(in);
  std::map<std::string, int> per_category;
  std::set<int64_t> lanes;
  for (const auto& e : doc["traceEvents"])
    if (e["ph"] == "X") ++per_category[e["cat"].get<std::string>()], lanes.insert(e["tid"].get<int64_t>());
  // 4 stages × 8 micro-batches of each pass: zero_bubble splits the backward.
  EXPECT_EQ(per_category["forward"], 32);
  EXPECT_EQ(per_category["backward"], 32);
  EXPECT_EQ(per_category["weight"], 32);
  EXPECT_EQ(lanes.size(), 4u);
}
