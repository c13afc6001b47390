// A failed write (here a file-size limit: the write fails with EFBIG, as it fails with ENOSPC on a
// full disk) stops the run with the file named and the reason, and leaves no half-written line.
#include <sys/resource.h>

#include <gtest/gtest.h>

#include <csignal>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ft/ft_support.h"
#include "support/temp_dir.h"

namespace moetrain::testing {
namespace {

namespace fs = std::filesystem;

// Runs `f` with RLIMIT_FSIZE at `bytes` and SIGXFSZ ignored (a child started inside inherits
// both): a write past the limit fails with EFBIG instead of killing the process.
template <class F>
auto with_file_size_limit(rlim_t bytes, F&& f) {
  rlimit old{};
  ::getrlimit(RLIMIT_FSIZE, &old);
  rlimit lim = old;
  lim.rlim_cur = bytes;
  ::setrlimit(RLIMIT_FSIZE, &lim);
  auto* previous = std::signal(SIGXFSZ, SIG_IGN);
  auto result = f();
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  return result;
}

TEST(FullDisk, AFailedMetricsWriteStopsTheRunAndLeavesOnlyWholeLines) {
  TempDir tmp("full_disk");
  const std::string cfg = write_tiny_run(tmp.path(), 100000, 0).string();
  const fs::path run = tmp / "run";
  // Big enough for the start (config, lock), small enough for metrics.jsonl to reach it soon.
  ProcessResult r = with_file_size_limit(12000, [&] {
    return run_moetrain({"train", "-c", cfg, "--set", "train.run_dir=" + run.string(), "--set",
                         "train.tensorboard=false"},
                        {{"OMP_NUM_THREADS", "1"}}, 60);
  });
  EXPECT_FALSE(r.timed_out) << r.output();
  EXPECT_NE(r.code, 0) << r.output();
  EXPECT_NE(r.output().find("cannot write " + (run / "metrics.jsonl").string()), std::string::npos)
      << r.output();
  EXPECT_NE(r.output().find("File too large"), std::string::npos) << r.output();
  std::ifstream in(run / "metrics.jsonl", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n') << "a half-written last line";
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);)
    EXPECT_FALSE(nlohmann::json::parse(line, nullptr, false).is_discarded()) << line;
}

// The event files and the checkpoints are checked the same way: the run stops naming the file.
TEST(FullDisk, AFailedEventOrCheckpointWriteStopsTheRunNamingTheFile) {
  struct Case {
    rlim_t limit;
    std::vector<std::string> extra;
    std::string names;
  };
  const std::vector<Case> cases = {
      // run_config.json (about 3 KB) fits under 4500 bytes; the event file reaches it soon.
      {4500, {"--set", "train.tensorboard=true"}, "events.out.tfevents."},
      {60000,
       {"--set", "train.tensorboard=false", "--set", "train.checkpoint_every=2"},
       "model.safetensors"}};
  for (const Case& c : cases) {
    TempDir tmp("full_disk_files");
    const std::string cfg = write_tiny_run(tmp.path(), 100000, 0).string();
    std::vector<std::string> args = {"train", "-c", cfg, "--set",
                                     "train.run_dir=" + (tmp / "run").string()};
    args.insert(args.end(), c.extra.begin(), c.extra.end());
    ProcessResult r = with_file_size_limit(c.limit, [&] {
      return run_moetrain(args, {{"OMP_NUM_THREADS", "1"}}, 60);
    });
    EXPECT_FALSE(r.timed_out) << r.output();
    EXPECT_NE(r.code, 0) << r.output();
    const std::size_t at = r.output().find("cannot write");
    ASSERT_NE(at, std::string::npos) << r.output();
    EXPECT_NE(r.output().find(c.names, at), std::string::npos) << r.output();
    EXPECT_NE(r.output().find("File too large", at), std::string::npos) << r.output();
  }
}

}  // namespace
}  // namespace moetrain::testing
