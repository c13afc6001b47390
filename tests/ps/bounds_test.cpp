// Parameter-server jobs checked against what their consistency rules promise, measured from the
// outside: the servers' per-update lines (RUN_DIR/metrics/server_I.jsonl: the clock each update's
// pushes were computed at and how many it summed), their summaries (RUN_DIR/ps/server_I.json:
// pushes received, late ones dropped, bytes on the wire) and the validation loss against sync
// runs of the same model, data and global batch; compressed pulls and half_sync the same way.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "io/metrics.h"
#include "ps/consistency.h"
#include "ps/process.h"  // tests/ps/process.h
#include "support/corpus.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

struct JobRun {
  fs::path dir;
  double val = -1;
  std::vector<nlohmann::json> servers;                  // ps/server_I.json
  std::vector<std::vector<nlohmann::json>> updates;     // metrics/server_I.jsonl
  std::map<int64_t, double> loss;                       // metrics.jsonl: step → loss
};

JobRun run_job(const TempDir& tmp, const std::string& name, std::vector<std::string> ps_args,
            int servers, int steps, int batch) {
  write_corpus(tmp / "data", 60000);
  std::vector<std::string> args = {"ps", "launch", "--timeout", "100", "--servers",
                                   std::to_string(servers)};
  args.insert(args.end(), ps_args.begin(), ps_args.end());
  args.insert(args.end(), {"--", "train"});
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp / "data", tmp / name, steps, batch)))
    args.push_back(s);
  Process p(args, tmp / (name + ".log"));
  const int code = p.wait(120);
  EXPECT_EQ(code, 0) << name << ":\n" << p.output();
  JobRun r;
  r.dir = tmp / name;
  if (code != 0) return r;
  r.val = val_loss(r.dir);
  const auto roles = read_role_metrics(r.dir);
  for (int s = 0; s < servers; ++s) {
    r.servers.push_back(read_json(r.dir / "ps" / ("server_" + std::to_string(s) + ".json")));
    const std::string role = "server_" + std::to_string(s);
    r.updates.push_back(roles.count(role) ? roles.at(role) : std::vector<nlohmann::json>{});
  }
  for (const auto& j : read_metrics(r.dir))
    if (j.contains("loss")) r.loss[j["step"].get<int64_t>()] = j["loss"].get<double>();
  return r;
}

int64_t stat(const JobRun& r, int s, const char* key) {
  return r.servers.at(s).at(key).get<int64_t>();
}

}  // namespace

namespace {

// The loss band. Sync with W workers is the single-process run (PsJob.SyncEqualsSingleProcess);
// a relaxed mode may lose progress to stale or dropped gradients, but must make at least the
// progress sync makes in half the steps: val(mode, T) ≤ val(sync, T/2). It may also gain, by
// applying more, noisier updates per global step (async), but not beyond the sync run's own
// progress over those steps again: val(mode, T) ≥ val(sync, T) − (val(sync, T/2) − val(sync, T)).
void expect_in_sync_band(const JobRun& mode, const JobRun& sync, const JobRun& half, const char* name) {
  ASSERT_GT(half.val, sync.val) << "the sync run did not improve from T/2 to T";
  const double gain = half.val - sync.val;
  std::printf("%s: val %.4f, sync %.4f, sync at T/2 %.4f\n", name, mode.val, sync.val, half.val);
  EXPECT_LE(mode.val, half.val) << name << " made less progress than sync in half the steps";
  EXPECT_GE(mode.val, sync.val - gain) << name << " beat sync by more than sync's last half";
}

// Async: every push is applied exactly once, on arrival, alone (no sum, no drop). Async has no
// staleness bound by design (ssp is the bounded mode, PsJob.SspBoundsStalenessAndBlocksTheFast-
// Worker); what it must keep is the count: W × T updates on every server, each worker's clocks
// 0..T−1 once each.
TEST(PsBounds, AsyncAppliesEveryPushOnceWithinTheSyncBand) {
  TempDir tmp("ps_async_bounds");
  const int W = 2, S = 2, T = 40, B = 4;
  const std::vector<std::string> w = {"--workers", std::to_string(W)};
  JobRun sync = run_job(tmp, "sync", w, S, T, B);
  JobRun half = run_job(tmp, "half", w, S, T / 2, B);
  auto a_args = w;
  a_args.insert(a_args.end(), {"--consistency", "async"});
  JobRun async = run_job(tmp, "async", a_args, S, T, B);
  ASSERT_EQ(async.servers.size(), static_cast<std::size_t>(S));
  for (int s = 0; s < S; ++s) {
    EXPECT_EQ(stat(async, s, "updates"), W * T) << s;
    EXPECT_EQ(stat(async, s, "pushes"), W * T) << s;
    EXPECT_EQ(stat(async, s, "late_dropped"), 0) << s;
    ASSERT_EQ(async.updates[s].size(), static_cast<std::size_t>(W * T)) << s;
    std::map<int64_t, std::multiset<int64_t>> clocks;
    for (const auto& u : async.updates[s]) {
      EXPECT_EQ(u.at("pushes").get<int64_t>(), 1) << u.dump();
      clocks[u.at("worker").get<int64_t>()].insert(u.at("clock").get<int64_t>());
    }
    ASSERT_EQ(clocks.size(), static_cast<std::size_t>(W));
    for (const auto& [worker, cs] : clocks) {
      std::multiset<int64_t> want;
      for (int64_t c = 0; c < T; ++c) want.insert(c);
      EXPECT_EQ(cs, want) << "server " << s << ", worker " << worker;
    }
  }
  expect_in_sync_band(async, sync, half, "async");
}

// Quorum q of W with one worker slowed 4×: each clock is applied once, from pushes of that very
// clock (staleness bound 0: an update's clock equals the version it applies to), summing between
// q and W of them; what came later for an applied clock was dropped and counted, never applied.
TEST(PsBounds, QuorumAppliesOnlyFreshPushesWithinTheSyncBand) {
  TempDir tmp("ps_quorum_bounds");
  const int W = 3, q = 2, T = 30, B = 2;
  const std::vector<std::string> w = {"--workers", std::to_string(W)};
  JobRun sync = run_job(tmp, "sync", w, 1, T, B);
  JobRun half = run_job(tmp, "half", w, 1, T / 2, B);
  auto q_args = w;
  q_args.insert(q_args.end(), {"--consistency", "quorum", "--quorum", std::to_string(q),
                               "--slowdown", "2=4"});
  JobRun quorum = run_job(tmp, "quorum", q_args, 1, T, B);
  ASSERT_EQ(quorum.servers.size(), 1u);
  EXPECT_EQ(stat(quorum, 0, "updates"), T);
  const int64_t late = stat(quorum, 0, "late_dropped"), pushes = stat(quorum, 0, "pushes");
  EXPECT_GT(late, 0) << "the slowed worker was never late";
  ASSERT_EQ(quorum.updates[0].size(), static_cast<std::size_t>(T));
  int64_t summed = 0;
  for (const auto& u : quorum.updates[0]) {
    const int64_t version_before = u.at("step").get<int64_t>() - 1;
    EXPECT_EQ(u.at("clock").get<int64_t>(), version_before) << "a stale push applied: " << u.dump();
    const int64_t n = u.at("pushes").get<int64_t>();
    EXPECT_GE(n, q) << u.dump();
    EXPECT_LE(n, W) << u.dump();
    summed += n;
  }
  EXPECT_EQ(summed + late, pushes) << "every push is either summed once or dropped";
  // Dropped pushes were computed and never applied: the job's gradient-accumulation efficiency
  // is the summed share. (The slowed worker's pushes mostly arrive after the fast ones finished
  // the job, so the per-update lines of metrics.jsonl see few of them.)
  EXPECT_DOUBLE_EQ(quorum.servers[0].at("grad_accum_efficiency").get<double>(),
                   static_cast<double>(summed) / static_cast<double>(pushes));
  EXPECT_LT(quorum.servers[0].at("grad_accum_efficiency").get<double>(), 1.0);
  for (const auto& j : read_metrics(quorum.dir)) {
    if (j.contains("pushes")) {
      EXPECT_LE(j.at("grad_accum_efficiency").get<double>(), 1.0);
    }
  }
  expect_in_sync_band(quorum, sync, half, "quorum");
}

// bf16 and sparse pushes end to end, against one sync run with dense f32 pushes. The tiny model
// routes 128 tokens per worker step top-2 over 4 experts per layer, and at this initialisation
// some experts get none in some steps (the job's summary shows the share): sparse pushes leave
// those out. The servers' byte counters are what arrived on the wire.
TEST(PsBounds, Bf16AndSparsePushesEndToEnd) {
  TempDir tmp("ps_push_bytes");
  const int W = 2, T = 20, B = 4;
  const std::vector<std::string> w = {"--workers", std::to_string(W)};
  auto dense_args = w;
  dense_args.push_back("--dense-push");
  JobRun dense = run_job(tmp, "dense", dense_args, 1, T, B);
  JobRun sparse = run_job(tmp, "sparse", w, 1, T, B);
  auto bf16_args = w;
  bf16_args.insert(bf16_args.end(), {"--push-compression", "bf16"});
  JobRun bf16 = run_job(tmp, "bf16", bf16_args, 1, T, B);
  ASSERT_FALSE(dense.servers.empty() || sparse.servers.empty() || bf16.servers.empty());
  for (const JobRun* r : {&dense, &sparse, &bf16}) EXPECT_EQ(stat(*r, 0, "pushes"), W * T);
  EXPECT_EQ(stat(dense, 0, "push_bytes"), stat(dense, 0, "dense_push_bytes"));
  EXPECT_LT(stat(sparse, 0, "push_bytes"), stat(dense, 0, "push_bytes"));
  std::printf("bytes: dense %lld sparse %lld bf16 %lld\n",
              static_cast<long long>(stat(dense, 0, "push_bytes")),
              static_cast<long long>(stat(sparse, 0, "push_bytes")),
              static_cast<long long>(stat(bf16, 0, "push_bytes")));
  // bf16 halves the values; headers and range lists are the rest.
  EXPECT_LT(stat(bf16, 0, "push_bytes"), 0.55 * stat(sparse, 0, "push_bytes"));
  // Sync with bf16 gradients follows the f32 run step by step: bf16 keeps 8 significant bits
  // (relative rounding ≤ 2^-9 per value), and Adam's update divides most of that out, so the
  // loss curves stay within a few thousandths; a bf16 push decoded wrongly (or not at all)
  // moves the loss by tenths.
  ASSERT_EQ(bf16.loss.size(), static_cast<std::size_t>(T));
  double worst = 0;
  for (auto [step, loss] : sparse.loss) worst = std::max(worst, std::fabs(bf16.loss[step] - loss));
  std::printf("bf16: worst per-step loss difference %.5f, val %.4f vs %.4f\n", worst, bf16.val,
              sparse.val);
  // Measured 3.4e-4 over 20 steps; the band leaves 15× for other machines' rounding paths.
  EXPECT_LE(worst, 0.005);
  EXPECT_NEAR(bf16.val, sparse.val, 0.005);
}

// Pulls in bf16 and int8 (--pull-compression): the servers keep f32 and send every training pull
// in the asked encoding, so each reply's values take exactly 2 (bf16) or 1 + 4/256 (int8) bytes a
// parameter instead of 4; the lead worker's final read stays f32 (the checkpoint holds the
// servers' values). Training on the decoded parameters ends within 1% of the f32-pull run's
// validation loss.
TEST(PsBounds, CompressedPullsCutTheWireBytesAndTrainLikeF32Pulls) {
  TempDir tmp("ps_pull_bytes");
  const int W = 2, S = 2, T = 30, B = 4;
  std::map<std::string, JobRun> runs;
  for (const char* enc : {"none", "bf16", "int8"})
    runs[enc] = run_job(tmp, enc, {"--workers", std::to_string(W), "--pull-compression", enc}, S,
                        T, B);
  for (const auto& [enc, r] : runs) ASSERT_EQ(r.servers.size(), static_cast<std::size_t>(S)) << enc;
  const int64_t header = 88;
  double total[3] = {0, 0, 0};
  for (int s = 0; s < S; ++s) {
    const auto keys = runs["none"].servers[s].at("keys");
    const int64_t n = keys[1].get<int64_t>() - keys[0].get<int64_t>();
    // Sync: W joining reads, W × T training pulls, the final read.
    const int64_t pulls = W + W * T + 1;
    int k = 0;
    for (const char* enc : {"none", "bf16", "int8"}) {
      const JobRun& r = runs[enc];
      EXPECT_EQ(stat(r, s, "pulls"), pulls) << enc;
      EXPECT_EQ(stat(r, s, "dense_pull_bytes"), pulls * (header + 4 * n)) << enc;
      const int64_t values = std::string(enc) == "none"   ? 4 * n
                             : std::string(enc) == "bf16" ? 2 * n
                                                          : n + 4 * ((n + 255) / 256);
      EXPECT_EQ(stat(r, s, "pull_bytes"), (pulls - 1) * (header + values) + header + 4 * n)
          << enc << " on server " << s;
      total[k++] += static_cast<double>(stat(r, s, "pull_bytes"));
    }
  }
  std::printf("pull bytes: f32 %.0f, bf16 %.0f (%.4f), int8 %.0f (%.4f)\n", total[0], total[1],
              total[1] / total[0], total[2], total[2] / total[0]);
  EXPECT_LT(total[1] / total[0], 0.52);
  EXPECT_LT(total[2] / total[0], 0.28);
  const double f32 = runs["none"].val;
  for (const char* enc : {"bf16", "int8"}) {
    std::printf("%s pulls: val %.4f, f32 pulls %.4f (%.3f%%)\n", enc, runs[enc].val, f32,
                100 * (runs[enc].val - f32) / f32);
    EXPECT_LE(std::fabs(runs[enc].val - f32), 0.01 * f32) << enc;
  }
  // The decoded parameters are what trained: each curve differs from the others.
  EXPECT_NE(runs["bf16"].loss, runs["none"].loss);
  EXPECT_NE(runs["int8"].loss, runs["none"].loss);
  EXPECT_NE(runs["int8"].loss, runs["bf16"].loss);
}

// half_sync with one worker slowed 2×: every push applied once on arrival, the servers' largest
// staleness within --staleness, and each worker's random waits exactly the seeded draws of the
// clocks it computed (train.seed = 1234 in the tiny config). Bad settings stop before anything
// starts, naming the flag.
TEST(PsBounds, HalfSyncKeepsTheStalenessBoundAndWaitsTheSeededTimes) {
  TempDir tmp("ps_half_sync");
  const int W = 2, T = 30, B = 2, s_bound = 1;
  const double wait_ms = 20;
  JobRun r = run_job(tmp, "half",
                     {"--workers", std::to_string(W), "--consistency", "half_sync", "--staleness",
                      std::to_string(s_bound), "--half-sync-wait-ms", "20", "--slowdown", "1=2"},
                     1, T, B);
  ASSERT_EQ(r.servers.size(), 1u);
  EXPECT_EQ(stat(r, 0, "updates"), W * T);
  EXPECT_EQ(stat(r, 0, "late_dropped"), 0);
  EXPECT_LE(stat(r, 0, "max_staleness"), s_bound);
  ASSERT_EQ(r.updates[0].size(), static_cast<std::size_t>(W * T));
  std::map<int64_t, std::multiset<int64_t>> clocks;
  for (const auto& u : r.updates[0]) {
    EXPECT_EQ(u.at("pushes").get<int64_t>(), 1) << u.dump();
    clocks[u.at("worker").get<int64_t>()].insert(u.at("clock").get<int64_t>());
  }
  ASSERT_EQ(clocks.size(), static_cast<std::size_t>(W));
  int seen = 0;
  for (const auto& e : fs::directory_iterator(r.dir / "ps")) {
    if (e.path().filename().string().rfind("worker_node", 0) != 0) continue;
    const auto j = read_json(e.path());
    const int64_t w = j.at("index").get<int64_t>();
    double want = 0;
    for (int64_t c : clocks.at(w)) want += ps::half_sync_wait(1234, w, c, wait_ms);
    EXPECT_NEAR(j.at("half_sync_wait_s").get<double>(), want, 1e-9) << "worker " << w;
    EXPECT_GT(want, 0.2 * T * wait_ms / 1000) << "the draws are far below the bound's half";
    ++seen;
  }
  EXPECT_EQ(seen, W);
  for (const auto& [worker, cs] : clocks) {
    std::multiset<int64_t> want;
    for (int64_t c = 0; c < T; ++c) want.insert(c);
    EXPECT_EQ(cs, want) << "worker " << worker;
  }
  write_corpus(tmp / "data", 60000);
  for (const auto& [flags, says] :
       std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--consistency", "half_sync"}, "--half-sync-wait-ms 0: with --consistency half_sync"},
           {{"--consistency", "ssp", "--half-sync-wait-ms", "5"},
            "--half-sync-wait-ms 5 is only meaningful with --consistency half_sync"},
           {{"--consistency", "half_sync", "--half-sync-wait-ms", "-1"},
            "--half-sync-wait-ms -1: with --consistency half_sync it must be in (0, 60000]"}}) {
    std::vector<std::string> args = {"ps", "launch"};
    args.insert(args.end(), flags.begin(), flags.end());
    args.insert(args.end(), {"--", "train", "--set", "train.run_dir=" + (tmp / "bad").string()});
    Process p(args, tmp / "bad.log");
    EXPECT_NE(p.wait(60), 0) << says;
    EXPECT_NE(p.output().find(says), std::string::npos) << p.output();
    EXPECT_FALSE(fs::exists(tmp / "bad")) << "something was written";
  }
}

}  // namespace
