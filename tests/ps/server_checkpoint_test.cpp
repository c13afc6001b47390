// Server checkpoints round-trip exactly (parameters, optimizer moments and step, worker clocks),
// keep only the newest three, and refuse a corrupted file, another key range or another
// configuration with a message naming the file and the reason.
#include <gtest/gtest.h>

#include <fstream>

#include "core/check.h"
#include "optim/optimizer.h"
#include "ps/server_checkpoint.h"
#include "support/expect_error.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::ps;
using moetrain::testing::expect_error;
using moetrain::testing::TempDir;
namespace fs = std::filesystem;

namespace {

struct Shard {
  std::vector<ParamRange> groups = {{0, 100, true}, {100, 60, false}};
  std::unique_ptr<Optimizer> opt =
      make_optimizer(default_optimizer_config("adamw"), groups, 40, 140);
  std::vector<float> params = std::vector<float>(100);

  void steps(int n) {
    std::vector<float> g(params.size());
    for (int s = 0; s < n; ++s) {
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = std::sin(0.1f * static_cast<float>(i + s));
      opt->step(params.data(), g.data(), 0.01f);
    }
  }
};

TEST(PsServerCheckpoint, RoundTripsExactlyAndKeepsTheNewestThree) {
  TempDir tmp("ps_ckpt");
  Shard a;
  for (int c = 1; c <= 5; ++c) {
    a.steps(1);
    write_server_checkpoint(tmp.path(), 2, c * 10, 40, 140, a.params.data(), *a.opt,
                            {{0, c * 10}, {3, c * 10 - 1}}, "hash");
  }
  EXPECT_EQ(list_server_checkpoints(tmp.path(), 2), (std::vector<int64_t>{30, 40, 50}));
  ServerCheckpoint c =
      read_server_checkpoint(server_checkpoint_path(tmp.path(), 2, 50), 40, 140, "hash");
  EXPECT_EQ(c.clock, 50);
  EXPECT_EQ(c.index, 2);
  EXPECT_EQ(c.params, a.params);
  EXPECT_EQ(c.worker_clocks, (std::map<int64_t, int64_t>{{0, 50}, {3, 49}}));
  Shard b;
  restore_optimizer(c, *b.opt);
  b.params = c.params;
  // Restored, both continue bit for bit.
  a.steps(3);
  b.steps(3);
  EXPECT_EQ(a.params, b.params);
  EXPECT_EQ(b.opt->step_count(), 8);
}

// A key range longer than the optimizer's (router bias and expert count keys past the
// parameters have no optimizer state): the buffers are written padded to the key range and
// restored into the optimizer's range; the update rule's own state (the importance averages'
// JSON) comes back as written.
TEST(PsServerCheckpoint, RangeBeyondTheOptimizerAndRuleStateRoundTrip) {
  TempDir tmp("ps_ckpt_extra");
  Shard a;
  a.steps(2);
  std::vector<float> values(a.params);
  values.resize(130, 7.0f);  // keys [40, 170): 30 keys past the optimizer's [40, 140)
  const std::string rule = R"({"importance_avg":[[0.1,0.30000000000000004]],"steps":2})";
  write_server_checkpoint(tmp.path(), 1, 20, 40, 170, values.data(), *a.opt, {}, "hash", 3, rule);
  const ServerCheckpoint c =
      read_server_checkpoint(server_checkpoint_path(tmp.path(), 1, 20), 40, 170, "hash");
  EXPECT_EQ(c.params, values);
  EXPECT_EQ(c.rule_state, rule);
  Shard b;
  restore_optimizer(c, *b.opt);
  std::copy_n(c.params.begin(), b.params.size(), b.params.begin());
  a.steps(2);
  b.steps(2);
  EXPECT_EQ(a.params, b.params);
}

TEST(PsServerCheckpoint, RefusesCorruptionAndMismatches) {
  TempDir tmp("ps_ckpt_bad");
  Shard a;
  a.steps(2);
  write_server_checkpoint(tmp.path(), 0, 20, 40, 140, a.params.data(), *a.opt, {}, "hash");
  const fs::path p = server_checkpoint_path(tmp.path(), 0, 20);
  expect_error([&] { read_server_checkpoint(p, 40, 150, "hash"); }, "this server holds [40, 150)");
  expect_error([&] { read_server_checkpoint(p, 40, 140, "other"); }, "configuration");
  // Flip one bit of the last tensor byte: the header still parses, the checksum does not match.
  {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    char x;
    f.get(x);
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(x ^ 1));
  }
  expect_error([&] { read_server_checkpoint(p, 40, 140, "hash"); }, "checksum mismatch");
  fs::resize_file(p, fs::file_size(p) - 9);
  EXPECT_THROW(read_server_checkpoint(p, 40, 140, "hash"), Error);
}

}  // namespace
