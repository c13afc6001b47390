// One run per run directory: a second trainer, in this process or another, stops at once with a
// message naming the holder and leaves the directory as it found it.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include "core/check.h"
#include "io/run_lock.h"
#include "support/corpus.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> small_settings(const TempDir& tmp) {
  return {"model.dim=32",
          "model.n_layers=1",
          "model.n_heads=4",
          "model.n_kv_heads=2",
          "model.expert_hidden=32",
          "model.n_experts=4",
          "model.top_k=2",
          "model.max_seq_len=32",
          "train.batch_size=4",
          "train.seq_len=32",
          "train.steps=2",
          "train.eval_every=0",
          "train.checkpoint_every=0",
          "train.progress=off",
          "data.dir=" + (tmp / "data").string(),
          "train.run_dir=" + (tmp / "run").string()};
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    out.insert(fs::relative(e.path(), dir).string());
  return out;
}

}  // namespace

TEST(RunLock, SecondTrainerOnOneRunDirectoryFails) {
  TempDir tmp("run_lock");
  write_corpus(tmp / "data", 20000);
  Trainer first(load_run_config("", small_settings(tmp)), false);
  const std::string lock_before = read_text(tmp / "run" / ".lock");
  EXPECT_NE(lock_before.find("pid " + std::to_string(::getpid())), std::string::npos)
      << lock_before;
  const auto files_before = listing(tmp / "run");
  try {
    Trainer second(load_run_config("", small_settings(tmp)), true);
    FAIL() << "a second trainer on a held run directory was constructed";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("in use by pid " + std::to_string(::getpid())), std::string::npos) << msg;
    EXPECT_NE(msg.find((tmp / "run").string()), std::string::npos) << msg;
  }
  EXPECT_EQ(listing(tmp / "run"), files_before);
  EXPECT_EQ(read_text(tmp / "run" / ".lock"), lock_before);
}

TEST(RunLock, LockIsReleasedWithItsHolder) {
  TempDir tmp("run_lock");
  fs::create_directories(tmp / "run");
  { RunLock held(tmp / "run"); }
  RunLock again(tmp / "run");
  EXPECT_TRUE(again.held());
}

TEST(RunLock, SecondTrainProcessExitsNamingTheHolder) {
  TempDir tmp("run_lock");
  write_corpus(tmp / "data", 20000);
  fs::create_directories(tmp / "run");
  const RunLock held(tmp / "run");  // this test process plays the running trainer
  const auto files_before = listing(tmp / "run");
  const fs::path cfg = tmp.write("empty.toml", "");
  // Appended piece by piece: GCC 12 warns (-Warray-bounds, wrongly) on a temporary's operator+.
  std::string cmd = MOETRAIN_BINARY;
  cmd += " train --resume --config " + cfg.string();
  for (const std::string& s : small_settings(tmp)) cmd += " --set " + s;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_NE(WEXITSTATUS(status), 0) << out;
  EXPECT_NE(out.find("in use by pid " + std::to_string(::getpid())), std::string::npos) << out;
  EXPECT_EQ(listing(tmp / "run"), files_before);
}
