// The memory estimate as a user meets it: `moetrain train --dry-run` prints each rank's bytes by
// kind for the layout (--np, dist.ep, dist.zero), the same bytes `moetrain plan` gives that
// layout; a run whose ranks would not fit in their memory cgroup is refused before it allocates,
// naming both figures per rank.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "support/memory_runs.h"
#include "support/temp_dir.h"
#include "train/memory_estimate.h"
#include "train/run_config.h"

namespace moetrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kData = "/nonexistent-data";  // the dry run and the planner read no data

// The settings of memory_model_args as a RunConfig, with `extra` overrides.
RunConfig memory_model_config(const std::vector<std::string>& extra) {
  std::vector<std::string> sets;
  std::istringstream in(memory_model_args(kData, "/tmp/unused", 2));
  for (std::string word; in >> word;)
    if (word != "--set" && word.find('=') != std::string::npos) sets.push_back(word);
  sets.insert(sets.end(), extra.begin(), extra.end());
  return load_run_config(std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml", sets);
}

// A CPU profile for `moetrain plan` (this trainer's state: the flat buffer of every expert).
fs::path cpu_profile(const TempDir& tmp) {
  const fs::path profile = tmp / "profile.toml";
  std::ofstream(profile)
      << "[device]\nname = \"cpu\"\npeak_flops_f32 = 1e11\nmemory_bytes = 16e9\n"
         "memory_bandwidth = 2e10\nthreads = 2\n[single_thread]\nname = \"cpu\"\n"
         "peak_flops_f32 = 5e10\nmemory_bytes = 16e9\nmemory_bandwidth = 1e10\n"
         "threads = 1\n[cluster]\nintra_node_bandwidth = 1e10\n"
         "inter_node_bandwidth = 1e10\nintra_node_latency = 1e-6\n"
         "inter_node_latency = 1e-6\n";
  return profile;
}

TEST(MemoryCli, DryRunPrintsEachRanksBytesForTheLayout) {
  const ShellResult r = shell(std::string(MOETRAIN_BINARY) +
                              memory_model_args(kData, "/tmp/unused", 2) +
                              " --dry-run --np 4 --set dist.ep=2 --set dist.zero=1");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("memory per rank (4 processes, dist.ep = 2, dist.zero = 1, "
                          "train.precision = f32):"),
            std::string::npos)
      << r.output;
  const auto rows = memory_table(r.output);
  ASSERT_EQ(rows.size(), 8u) << r.output;
  // The state by hand: embedding and head 2 × 256 × 256, the final norm 256; per layer two norms
  // 2 × 256, q and o 2 × 256 × 256, k and v 2 × (2 × 64) × 256, the router 8 × 256; the experts
  // 4 layers × 8 × 3 × 1024 × 256 (26 093 824 parameters in all). Each rank's flat buffer holds all of them (weights, gradients), its optimizer
  // steps the dense ones and its 4 experts, AdamW's two moments sharded over the 4 ranks (dense)
  // and over the 2 replicas of each expert.
  const double experts = 4.0 * 8 * 3 * 1024 * 256;
  const double dense =
      2 * 256 * 256 + 256 + 4 * (2 * 256 + 2 * 256 * 256 + 2 * 128 * 256 + 8 * 256);
  ASSERT_EQ(dense + experts, 26093824);
  EXPECT_EQ(rows.at("parameters"), 4 * (dense + experts));
  EXPECT_EQ(rows.at("gradients"), 4 * (dense + experts));
  EXPECT_EQ(rows.at("optimizer state"), 8 * (dense / 4 + experts / 2 / 2));
  EXPECT_EQ(rows.at("low-precision copy"), 0);
  EXPECT_GT(rows.at("activations"), 0);
  EXPECT_GT(rows.at("buffers"), 0);
  // The baseline is this process's own resident memory, measured: a binary and its libraries.
  EXPECT_GT(rows.at("process baseline"), 1 << 20);
  double sum = 0;
  for (const auto& [name, bytes] : rows)
    if (name != "total") sum += bytes;
  EXPECT_NEAR(rows.at("total"), sum, 8);  // each row rounded to a byte
  EXPECT_NE(r.output.find("available: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("for 4 ranks on this machine: fits"), std::string::npos) << r.output;
  // In-process, the same function on the same layout.
  const RunConfig cfg = memory_model_config({"dist.ep=2", "dist.zero=1"});
  const MemoryEstimate e = rank_memory(cfg.model, 4, 64, trainer_layout(cfg, 4, 0));
  EXPECT_EQ(rows.at("activations"), static_cast<int64_t>(e.activations));
  EXPECT_EQ(rows.at("buffers"), static_cast<int64_t>(e.buffers));
}

// `moetrain plan` on a CPU profile (this trainer's state) and the dry run: the same bytes.
TEST(MemoryCli, PlanAndDryRunGiveTheSameBytes) {
  TempDir tmp("memory_plan");
  const fs::path profile = cpu_profile(tmp);
  for (const std::string& layout : {std::string("--np 1"), std::string("--np 2 --set dist.ep=2"),
                                    std::string("--np 4 --set dist.ep=2 --set dist.zero=1"),
                                    std::string("--np 2 --set train.precision=bf16")}) {
    const std::string args = memory_model_args(kData, (tmp / "run").string(), 2);
    const ShellResult dry = shell(std::string(MOETRAIN_BINARY) + args + " --dry-run " + layout);
    ASSERT_EQ(dry.code, 0) << dry.output;
    const auto rows = memory_table(dry.output);
    std::string plan_args = args.substr(args.find(" --set"));
    std::string procs = layout.substr(5, layout.find(' ', 5) == std::string::npos
                                             ? std::string::npos
                                             : layout.find(' ', 5) - 5);
    const std::string rest = layout.find(' ', 5) == std::string::npos
                                 ? ""
                                 : layout.substr(layout.find(' ', 5));
    const ShellResult plan = shell(std::string(MOETRAIN_BINARY) + " plan -c " +
                                   MOETRAIN_SOURCE_DIR + "/configs/tiny.toml" + plan_args + rest +
                                   " --profile " + profile.string() + " --procs " + procs +
                                   " --json");
    ASSERT_EQ(plan.code, 0) << plan.output;
    const auto mem = nlohmann::json::parse(plan.output)["memory"];
    auto bytes = [&](const char* key) { return static_cast<int64_t>(mem[key].get<double>()); };
    EXPECT_EQ(rows.at("parameters"), bytes("params_bytes")) << layout;
    EXPECT_EQ(rows.at("gradients"), bytes("grads_bytes")) << layout;
    EXPECT_EQ(rows.at("optimizer state"), bytes("optimizer_bytes")) << layout;
    EXPECT_EQ(rows.at("low-precision copy"), bytes("low_precision_bytes")) << layout;
    EXPECT_EQ(rows.at("activations"), bytes("activations_bytes")) << layout;
    EXPECT_EQ(rows.at("buffers"), bytes("buffers_bytes")) << layout;
  }
}

// ZeRO-3 on 4 ranks with dist.ep = 2: `moetrain plan --zero 3` gives the bytes of rank_memory on
// the dry run's layout (trainer_layout) with dist.zero = 3, and the dry run prints the same.
TEST(MemoryCli, PlanAndDryRunGiveTheSameBytesUnderZeroThree) {
  TempDir tmp("memory_plan_zero3");
  const fs::path profile = cpu_profile(tmp);
  const std::string args = memory_model_args(kData, (tmp / "run").string(), 2);
  const ShellResult plan =
      shell(std::string(MOETRAIN_BINARY) + " plan -c " + MOETRAIN_SOURCE_DIR +
            "/configs/tiny.toml" + args.substr(args.find(" --set")) +
            " --set dist.ep=2 --zero 3 --profile " + profile.string() + " --procs 4 --json");
  ASSERT_EQ(plan.code, 0) << plan.output;
  const auto mem = nlohmann::json::parse(plan.output)["memory"];
  auto bytes = [&](const char* key) { return static_cast<int64_t>(mem[key].get<double>()); };
  RunConfig cfg = memory_model_config({"dist.ep=2"});
  cfg.dist.zero = 3;
  const MemoryEstimate e = rank_memory(cfg.model, 4, 64, trainer_layout(cfg, 4, 0));
  EXPECT_EQ(bytes("params_bytes"), static_cast<int64_t>(e.parameters));
  EXPECT_EQ(bytes("grads_bytes"), static_cast<int64_t>(e.gradients));
  EXPECT_EQ(bytes("optimizer_bytes"), static_cast<int64_t>(e.optimizer));
  EXPECT_EQ(bytes("low_precision_bytes"), static_cast<int64_t>(e.low_precision));
  EXPECT_EQ(bytes("activations_bytes"), static_cast<int64_t>(e.activations));
  EXPECT_EQ(bytes("buffers_bytes"), static_cast<int64_t>(e.buffers));
  // By hand (the shapes of DryRunPrintsEachRanksBytesForTheLayout): the shard, dense over the 4
  // ranks and the 4 own experts of each block over their 2 replicas, and of two blocks gathered
  // (each its dense tensors and 4 of its 8 experts) what lies outside that shard: 3/4 of the
  // dense tensors, 1/2 of the experts; the gradients of two whole such blocks.
  const double experts = 4.0 * 8 * 3 * 1024 * 256;
  const double dense =
      2 * 256 * 256 + 256 + 4 * (2 * 256 + 2 * 256 * 256 + 2 * 128 * 256 + 8 * 256);
  const double block_dense = 2 * 256 + 2 * 256 * 256 + 2 * 128 * 256 + 8 * 256;
  const double block = block_dense + 4 * 3 * 1024 * 256;
  const double block_out = block_dense * 3 / 4 + 4 * 3 * 1024 * 256 / 2;
  EXPECT_EQ(bytes("params_bytes"), 4 * (dense / 4 + experts / 2 / 2 + 2 * block_out));
  EXPECT_EQ(bytes("grads_bytes"), 4 * 2 * block);
  EXPECT_EQ(bytes("optimizer_bytes"), 8 * (dense / 4 + experts / 2 / 2));
  const ShellResult dry = shell(std::string(MOETRAIN_BINARY) + args +
                                " --dry-run --np 4 --set dist.ep=2 --set dist.zero=3");
  ASSERT_EQ(dry.code, 0) << dry.output;
  const auto rows = memory_table(dry.output);
  EXPECT_EQ(rows.at("parameters"), bytes("params_bytes"));
  EXPECT_EQ(rows.at("gradients"), bytes("grads_bytes"));
  EXPECT_EQ(rows.at("optimizer state"), bytes("optimizer_bytes"));
  EXPECT_EQ(rows.at("low-precision copy"), bytes("low_precision_bytes"));
  EXPECT_EQ(rows.at("activations"), bytes("activations_bytes"));
  EXPECT_EQ(rows.at("buffers"), bytes("buffers_bytes"));
}

// ZeRO 0-3 with the optimizer state in memory and offloaded (dist.offload = host_file) on 2
// processes: `moetrain plan` prints the dry run's bytes, offloaded both by the config and by
// --offload. Offloaded, the optimizer state leaves the resident bytes and the buffers hold the
// store's ring more: 3 chunks of 1 Mi f32 elements for each of AdamW's 2 moments.
TEST(MemoryCli, PlanAndDryRunGiveTheSameBytesByZeroStageAndOffload) {
  TempDir tmp("memory_plan_offload");
  const fs::path profile = cpu_profile(tmp);
  const std::string args = memory_model_args(kData, (tmp / "run").string(), 2);
  const std::string plan = std::string(MOETRAIN_BINARY) + " plan -c " + MOETRAIN_SOURCE_DIR +
                           "/configs/tiny.toml" + args.substr(args.find(" --set")) +
                           " --profile " + profile.string() + " --procs 2 --json";
  for (int zero = 0; zero <= 3; ++zero) {
    int64_t buffers[2] = {0, 0};
    for (bool offload : {false, true}) {
      const std::string set = " --set dist.zero=" + std::to_string(zero) +
                              (offload ? " --set dist.offload=host_file" : "");
      const ShellResult dry =
          shell(std::string(MOETRAIN_BINARY) + args + " --dry-run --np 2" + set);
      ASSERT_EQ(dry.code, 0) << dry.output;
      const auto rows = memory_table(dry.output);
      const std::string flags =
          " --zero " + std::to_string(zero) + (offload ? " --offload" : " --offload=none");
      for (const std::string& how : {set, flags}) {
        const ShellResult p = shell(plan + how);
        ASSERT_EQ(p.code, 0) << p.output;
        const auto mem = nlohmann::json::parse(p.output)["memory"];
        auto bytes = [&](const char* key) { return static_cast<int64_t>(mem[key].get<double>()); };
        const std::string what = "plan" + how;
        EXPECT_EQ(rows.at("parameters"), bytes("params_bytes")) << what;
        EXPECT_EQ(rows.at("gradients"), bytes("grads_bytes")) << what;
        EXPECT_EQ(rows.at("optimizer state"), bytes("optimizer_bytes")) << what;
        EXPECT_EQ(rows.at("low-precision copy"), bytes("low_precision_bytes")) << what;
        EXPECT_EQ(rows.at("activations"), bytes("activations_bytes")) << what;
        EXPECT_EQ(rows.at("buffers"), bytes("buffers_bytes")) << what;
      }
      if (offload) {
        EXPECT_EQ(rows.at("optimizer state"), 0) << "zero " << zero;
      }
      buffers[offload] = rows.at("buffers");
    }
    EXPECT_EQ(buffers[1] - buffers[0], 3 * 2 * (int64_t{1} << 20) * 4) << "zero " << zero;
  }
  const ShellResult bad = shell(plan + " --offload=disk");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.output.find("--offload=disk: allowed are none and host_file"), std::string::npos)
      << bad.output;
}

// A memory cgroup of its own whose limit is below the estimate: the run stops at start-up with
// both figures per rank. Needs permission to create a cgroup v1 memory group; the group is
// removed whatever happens.
TEST(MemoryCli, ARunThatWouldNotFitItsCgroupIsRefused) {
  const fs::path root = "/sys/fs/cgroup/memory";
  const fs::path group = root / ("moetrain_test_" + std::to_string(::getpid()));
  std::error_code ec;
  if (!fs::is_directory(root) || !fs::create_directory(group, ec) || ec)
    GTEST_SKIP() << "cannot create a memory cgroup under " << root.string() << ": "
                 << (ec ? ec.message() : "no cgroup v1 memory controller");
  struct Remove {
    fs::path dir;
    ~Remove() { ::rmdir(dir.c_str()); }
  } remove{group};
  // The model's state alone (parameters, gradients, AdamW moments) is 398 MiB, its activations
  // 75 MiB more: the estimate is above this limit whatever the process's baseline.
  constexpr int64_t kLimit = 400ll << 20;
  std::ofstream(group / "memory.limit_in_bytes") << kLimit;
  std::ifstream check(group / "memory.limit_in_bytes");
  int64_t set = 0;
  if (!(check >> set) || set != kLimit) GTEST_SKIP() << "the cgroup's limit could not be set";
  TempDir tmp("memory_refused");
  // The shell moves itself into the group, then becomes the trainer (which inherits it).
  const ShellResult r =
      shell("sh -c 'echo $$ > " + (group / "cgroup.procs").string() + " && exec " +
            MOETRAIN_BINARY + memory_model_args(kData, (tmp / "run").string(), 2) + "'");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_GT(needed_gib(r.output), static_cast<double>(kLimit) / (1ll << 30)) << r.output;
  EXPECT_NE(r.output.find("of memory per rank (parameters 99.5 MiB"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("available (the memory cgroup's memory.limit_in_bytes)"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(tmp / "run" / "metrics.jsonl")) << r.output;
}

}  // namespace
}  // namespace moetrain::testing
