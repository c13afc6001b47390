// The consistency rules without sockets: which pushes each update sums and in which order, when
// it applies, what is dropped, and when a pull may be answered.
#include "ps/consistency.h"

#include "core/check.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

using namespace moetrain::ps;

namespace {

ConsistencyRules rules(Consistency mode, std::vector<int64_t> workers, int64_t quorum = 0,
                       int64_t staleness = 0) {
  ConsistencyConfig c;
  c.mode = mode;
  c.quorum = quorum;
  c.staleness = staleness;
  c.workers_at_start = static_cast<int64_t>(workers.size());
  ConsistencyRules r(c);
  r.set_active(std::move(workers));
  return r;
}

}  // namespace

TEST(Consistency, SyncWaitsForEveryActiveWorkerAndSumsInWorkerOrder) {
  ConsistencyRules r = rules(Consistency::Sync, {2, 0, 1});
  EXPECT_EQ(r.push(2, 0, 20), PushFate::Queued);
  EXPECT_EQ(r.push(0, 0, 0), PushFate::Queued);
  EXPECT_FALSE(r.next_update());
  EXPECT_FALSE(r.pull_ready(0, 1));
  EXPECT_TRUE(r.pull_ready(0, 0));
  EXPECT_TRUE(r.pull_ready(0, -1));  // a join reads now
  // A push for the next clock waits behind the current one.
  EXPECT_EQ(r.push(0, 1, 100), PushFate::Queued);
  EXPECT_EQ(r.push(1, 0, 10), PushFate::Ready);
  auto u = r.next_update();
  ASSERT_TRUE(u);
  EXPECT_EQ(u->version, 0);
  EXPECT_EQ(u->clock, 0);
  EXPECT_EQ(u->workers, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(u->ids, (std::vector<int64_t>{0, 10, 20}));
  EXPECT_EQ(u->worker, -1);
  EXPECT_EQ(r.schedule_step(), 0);
  EXPECT_EQ(r.applied(*u), (std::vector<int64_t>{0, 10, 20}));
  EXPECT_EQ(r.version(), 1);
  EXPECT_TRUE(r.pull_ready(0, 1));
  EXPECT_EQ(r.pull_answered(0, 1), 1);
  EXPECT_FALSE(r.next_update());  // clock 1 has one push of three
  // A push for a clock already applied is late.
  EXPECT_EQ(r.push(2, 0, 21), PushFate::Late);
}

TEST(Consistency, SyncWorkerLostMidClockCompletesTheClock) {
  ConsistencyRules r = rules(Consistency::Sync, {0, 1});
  EXPECT_EQ(r.push(0, 0, 1), PushFate::Queued);
  r.set_active({0});  // worker 1 died before pushing
  auto u = r.next_update();
  ASSERT_TRUE(u);
  EXPECT_EQ(u->ids, (std::vector<int64_t>{1}));
  r.applied(*u);
  // Its push, arriving after it was declared dead, is refused.
  EXPECT_EQ(r.push(1, 1, 2), PushFate::NotActive);
}

TEST(Consistency, SyncRejoinCountsTheNewWorkerFromTheNextClock) {
  ConsistencyRules r = rules(Consistency::Sync, {0});
  r.push(0, 0, 1);
  r.applied(*r.next_update());
  r.set_active({0, 1});
  EXPECT_EQ(r.pull_answered(1, -1), 1);  // the newcomer starts at the current clock
  EXPECT_EQ(r.push(0, 1, 2), PushFate::Queued);
  EXPECT_FALSE(r.next_update());
  EXPECT_EQ(r.push(1, 1, 3), PushFate::Ready);
  EXPECT_EQ(r.next_update()->ids, (std::vector<int64_t>{2, 3}));
}

TEST(Consistency, QuorumTakesTheFirstQAndDropsLateOnes) {
  ConsistencyRules r = rules(Consistency::Quorum, {0, 1, 2}, 2);
  EXPECT_EQ(r.push(2, 0, 20), PushFate::Queued);
  EXPECT_EQ(r.push(1, 0, 10), PushFate::Ready);
  auto u = r.next_update();
  ASSERT_TRUE(u);
  EXPECT_EQ(u->workers, (std::vector<int64_t>{1, 2}));  // worker-index order, not arrival
  EXPECT_EQ(u->ids, (std::vector<int64_t>{10, 20}));
  r.applied(*u);
  EXPECT_EQ(r.push(0, 0, 0), PushFate::Late);
  // The late worker is told to go on at the current clock.
  EXPECT_EQ(r.pull_answered(0, 1), 1);
}

TEST(Consistency, QuorumIsCappedByTheActiveWorkers) {
  ConsistencyRules r = rules(Consistency::Quorum, {0, 1, 2}, 3);
  r.push(0, 0, 0);
  r.push(1, 0, 1);
  EXPECT_FALSE(r.next_update());
  r.set_active({0, 1});  // worker 2 lost: 2 of 2 suffice
  auto u = r.next_update();
  ASSERT_TRUE(u);
  EXPECT_EQ(u->ids, (std::vector<int64_t>{0, 1}));
}

TEST(Consistency, AsyncAppliesEachPush) {
  ConsistencyRules r = rules(Consistency::Async, {0, 1});
  EXPECT_EQ(r.push(1, 0, 7), PushFate::Ready);
  auto u = r.next_update();
  ASSERT_TRUE(u);
  EXPECT_EQ(u->ids, (std::vector<int64_t>{7}));
  EXPECT_EQ(u->clock, 0);
  EXPECT_EQ(u->worker, 1);
  EXPECT_EQ(u->worker_clock, 1);
  EXPECT_FALSE(r.next_update());  // handed out once
  EXPECT_EQ(r.applied(*u), (std::vector<int64_t>{7}));
  EXPECT_EQ(r.push(1, 1, 8), PushFate::Ready);
  u = r.next_update();
  EXPECT_EQ(u->version, 1);
  r.applied(*u);
  // Two workers: the schedule advances once per two pushes.
  EXPECT_EQ(r.schedule_step(), 1);
  EXPECT_TRUE(r.pull_ready(0, 100));
  EXPECT_EQ(r.worker_clocks().at(1), 2);
}

TEST(Consistency, SspBlocksAPullUntilTheSlowestIsWithinTheStaleness) {
  ConsistencyRules r = rules(Consistency::Ssp, {0, 1}, 0, 2);
  EXPECT_EQ(r.pull_answered(0, -1), 0);
  EXPECT_EQ(r.pull_answered(1, -1), 0);
  for (int64_t c = 0; c < 3; ++c) {
    r.push(0, c, c);
    r.applied(*r.next_update());
  }
  // Worker 0 is at clock 3, worker 1 at 0: a pull for clock 3 needs the slowest at 1.
  EXPECT_TRUE(r.pull_ready(0, 2));
  EXPECT_FALSE(r.pull_ready(0, 3));
  r.push(1, 0, 10);
  r.applied(*r.next_update());
  EXPECT_TRUE(r.pull_ready(0, 3));
  EXPECT_EQ(r.pull_answered(0, 3), 3);
  EXPECT_EQ(r.max_staleness(), 2);
  // A worker not active is never held back.
  EXPECT_TRUE(r.pull_ready(5, 100));
}

// half_sync keeps ssp's bound on the servers: each push applies alone on arrival, and a pull for
// clock c waits for the slowest active worker to reach c − s.
TEST(Consistency, HalfSyncAppliesEachPushAndBlocksAPullBeyondTheStaleness) {
  ConsistencyRules r = rules(Consistency::HalfSync, {0, 1}, 0, 1);
  r.pull_answered(0, -1);
  r.pull_answered(1, -1);
  for (int64_t c = 0; c < 2; ++c) {
    EXPECT_EQ(r.push(0, c, c), PushFate::Ready);
    const auto u = r.next_update();
    ASSERT_TRUE(u.has_value());
    EXPECT_EQ(u->ids, std::vector<int64_t>{c});
    r.applied(*u);
  }
  EXPECT_EQ(r.version(), 2);
  EXPECT_TRUE(r.pull_ready(0, 1));
  EXPECT_FALSE(r.pull_ready(0, 2)) << "worker 1 is at 0, two clocks behind";
  r.push(1, 0, 10);
  r.applied(*r.next_update());
  EXPECT_TRUE(r.pull_ready(0, 2));
  EXPECT_EQ(r.pull_answered(0, 2), 2);
  EXPECT_EQ(r.max_staleness(), 1);
}

// The random wait: in [0, bound), the same for the same (seed, worker, clock), different across
// workers, clocks and seeds, and uniform: mean bound / 2 and a quarter of the draws under
// bound / 4, within 5 standard errors over 20000 draws.
TEST(Consistency, HalfSyncWaitIsSeededUniformAndBounded) {
  const double bound_ms = 40;
  EXPECT_EQ(half_sync_wait(7, 1, 5, bound_ms), half_sync_wait(7, 1, 5, bound_ms));
  EXPECT_NE(half_sync_wait(7, 1, 5, bound_ms), half_sync_wait(7, 0, 5, bound_ms));
  EXPECT_NE(half_sync_wait(7, 1, 5, bound_ms), half_sync_wait(7, 1, 6, bound_ms));
  EXPECT_NE(half_sync_wait(7, 1, 5, bound_ms), half_sync_wait(8, 1, 5, bound_ms));
  const int n = 20000;
  double sum = 0;
  int low = 0;
  for (int w = 0; w < 4; ++w)
    for (int c = 0; c < n / 4; ++c) {
      const double t = half_sync_wait(1234, w, c, bound_ms);
      ASSERT_GE(t, 0.0);
      ASSERT_LT(t, bound_ms / 1000.0);
      sum += t;
      low += t < bound_ms / 4000.0 ? 1 : 0;
    }
  const double b = bound_ms / 1000.0;
  EXPECT_NEAR(sum / n, b / 2, 5 * b / std::sqrt(12.0 * n));
  EXPECT_NEAR(static_cast<double>(low) / n, 0.25, 5 * std::sqrt(0.25 * 0.75 / n));
}

// average sums per clock as sync does: every active worker's push, in worker-index order, and a
// pull waits for the clock's update.
TEST(Consistency, AverageWaitsForEveryActiveWorkerLikeSync) {
  ConsistencyRules r = rules(Consistency::Average, {1, 0});
  EXPECT_EQ(r.push(1, 0, 11), PushFate::Queued);
  EXPECT_FALSE(r.pull_ready(1, 1));
  EXPECT_EQ(r.push(0, 0, 10), PushFate::Ready);
  const auto u = r.next_update();
  ASSERT_TRUE(u.has_value());
  EXPECT_EQ(u->ids, (std::vector<int64_t>{10, 11}));
  r.applied(*u);
  EXPECT_TRUE(r.pull_ready(1, 1));
  EXPECT_EQ(r.push(0, 0, 12), PushFate::Late);
}

// average over groups: each rank pushes its keys' parameters × its group's share of the global
// batch (zero elsewhere) with its own rows, so a clock's rows add up to the global batch and the
// sum of the four pushes, in worker-index order, is the row-weighted mean of the two groups'
// parameters. Group {0, 1}: 2 + 2 of 12 rows, rank 0 holding keys 0 and 1; group {2, 3}: 4 + 4
// rows, split the other way. Every key is one nonzero term per group plus exact zeros, so the
// sum is the two products added in group order, bitwise.
TEST(Consistency, AverageOverGroupsIsTheRowWeightedMeanOfTheGroupsParameters) {
  ConsistencyRules r = rules(Consistency::Average, {0, 1, 2, 3});
  EXPECT_EQ(r.push(3, 0, 3, 2), PushFate::Queued);
  EXPECT_EQ(r.push(0, 0, 0, 2), PushFate::Queued);
  EXPECT_EQ(r.push(2, 0, 2, 2), PushFate::Queued);
  EXPECT_EQ(r.push(1, 0, 1, 2), PushFate::Ready);
  const auto u = r.next_update();
  ASSERT_TRUE(u);
  EXPECT_EQ(u->ids, (std::vector<int64_t>{0, 1, 2, 3}));

  const float pa[4] = {1.5f, -2.25f, 3.0f, 0.1f}, pb[4] = {5.0f, 0.7f, -7.5f, 8.25f};
  const float sa = 4.0f / 12.0f, sb = 8.0f / 12.0f;
  const std::vector<std::vector<int>> held = {{0, 1}, {2, 3}, {0, 2}, {1, 3}};
  std::vector<std::vector<float>> pushed(4, std::vector<float>(4, 0.0f));
  for (int w = 0; w < 4; ++w)
    for (int k : held[static_cast<std::size_t>(w)])
      pushed[static_cast<std::size_t>(w)][static_cast<std::size_t>(k)] =
          w < 2 ? pa[k] * sa : pb[k] * sb;
  const int64_t rows[4] = {2, 2, 4, 4};
  std::vector<PushView> in;
  for (int64_t id : u->ids)
    in.push_back({pushed[static_cast<std::size_t>(id)].data(), rows[id], 12, 1.0});
  float out[4];
  const SumResult s = sum_pushes(in, 4, out);
  EXPECT_EQ(s.rows, 12);
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(out[k], pa[k] * sa + pb[k] * sb) << "key " << k;
    EXPECT_NEAR(out[k], (4.0 * pa[k] + 8.0 * pb[k]) / 12.0, 1e-6 * (1 + std::fabs(out[k])));
  }
  // One group: the share is 1 and the mean is the group's parameters, exactly.
  const float one[2] = {pa[0], 0.0f}, other[2] = {0.0f, pa[1]};
  sum_pushes({{one, 2, 4, 0}, {other, 2, 4, 0}}, 2, out);
  EXPECT_EQ(out[0], pa[0]);
  EXPECT_EQ(out[1], pa[1]);
}

TEST(Consistency, SspLostWorkerNoLongerHoldsOthersBackAndARejoinStartsLevel) {
  ConsistencyRules r = rules(Consistency::Ssp, {0, 1}, 0, 0);
  r.pull_answered(0, -1);
  r.pull_answered(1, -1);
  r.push(0, 0, 0);
  r.applied(*r.next_update());
  EXPECT_FALSE(r.pull_ready(0, 1));  // worker 1 is still at 0
  r.set_active({0});
  EXPECT_TRUE(r.pull_ready(0, 1));
  EXPECT_FALSE(r.worker_clocks().count(1));
  // Rejoining, it starts level with the slowest other worker.
  r.set_active({0, 1});
  EXPECT_EQ(r.pull_answered(1, -1), 1);
  EXPECT_EQ(r.worker_clocks().at(1), 1);
}

TEST(Consistency, RestoreDropsEverythingPending) {
  ConsistencyRules r = rules(Consistency::Sync, {0, 1});
  r.push(0, 0, 0);
  r.push(1, 0, 1);
  r.applied(*r.next_update());
  EXPECT_EQ(r.version(), 1);
  r.push(0, 1, 5);
  r.push(1, 2, 6);
  auto freed = r.restore(0, {{0, 3}});
  std::sort(freed.begin(), freed.end());
  EXPECT_EQ(freed, (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(r.version(), 0);
  EXPECT_EQ(r.worker_clocks().at(0), 3);
  EXPECT_FALSE(r.next_update());
  // The clock undone is pushed again.
  EXPECT_EQ(r.push(0, 0, 7), PushFate::Queued);
}

TEST(Consistency, BackupReplayAdvancesVersionAndWorkerClock) {
  ConsistencyRules r = rules(Consistency::Async, {0, 1});
  r.replayed(1, 4);
  r.replayed(-1, 0);
  EXPECT_EQ(r.version(), 2);
  EXPECT_EQ(r.worker_clocks().at(1), 4);
}

// Worker groups outside sync: groups {0, 1} and {2, 3} of 2. A group's pushes of a clock wait for
// each other and make one update, summed in worker-index order whatever the arrival order; every
// rank's clock moves with it, and the schedule counts updates per group.
TEST(Consistency, AsyncAppliesAGroupsPushesOfAClockAsOneUpdate) {
  ConsistencyRules r = rules(Consistency::Async, {0, 1, 2, 3});
  EXPECT_EQ(r.push(1, 0, 11, 2), PushFate::Queued);
  EXPECT_FALSE(r.next_update());
  // Its pull waits for the group's update; a rank whose part is not in yet reads now.
  EXPECT_FALSE(r.pull_ready(1, 1));
  EXPECT_TRUE(r.pull_ready(0, 1));
  EXPECT_EQ(r.push(3, 0, 31, 2), PushFate::Queued);
  EXPECT_EQ(r.pending_pushes(), 2);
  EXPECT_EQ(r.push(0, 0, 10, 2), PushFate::Ready);
  auto u = r.next_update();
  ASSERT_TRUE(u);
  EXPECT_EQ(u->ids, (std::vector<int64_t>{10, 11}));
  EXPECT_EQ(u->workers, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(u->worker, 0);
  EXPECT_EQ(u->worker_clock, 1);
  EXPECT_EQ(u->group_size, 2);
  EXPECT_EQ(r.applied(*u), (std::vector<int64_t>{10, 11}));
  EXPECT_TRUE(r.pull_ready(1, 1));
  EXPECT_EQ(r.worker_clocks().at(0), 1);
  EXPECT_EQ(r.worker_clocks().at(1), 1);
  // Group {2, 3}'s clock 0 completes the first global step: two groups, one update each.
  EXPECT_EQ(r.push(2, 0, 30, 2), PushFate::Ready);
  u = r.next_update();
  EXPECT_EQ(u->ids, (std::vector<int64_t>{30, 31}));
  r.applied(*u);
  EXPECT_EQ(r.schedule_step(), 1);
  // A group of another size is refused, naming it.
  EXPECT_THROW(r.push(0, 1, 12, 4), moetrain::Error);
}

// A group whose rank died mid-clock: its parts are freed at the next update, a roll-back frees
// what waits, and a backup's replay moves every rank's clock.
TEST(Consistency, GroupPartsOfALostRankAreFreedAndAReplayMovesTheGroupsClocks) {
  ConsistencyRules r = rules(Consistency::Ssp, {0, 1, 2, 3}, 0, 4);
  EXPECT_EQ(r.push(2, 0, 20, 2), PushFate::Queued);
  r.set_active({0, 1});  // group {2, 3} went down
  r.push(0, 0, 10, 2);
  EXPECT_EQ(r.push(1, 0, 11, 2), PushFate::Ready);
  const auto u = r.next_update();
  EXPECT_EQ(r.applied(*u), (std::vector<int64_t>{10, 11, 20}));
  EXPECT_EQ(r.pending_pushes(), 0);
  r.push(0, 1, 12, 2);
  EXPECT_EQ(r.restore(0, {}), (std::vector<int64_t>{12}));
  ConsistencyRules b = rules(Consistency::Ssp, {0, 1, 2, 3}, 0, 4);
  b.replayed(2, 3, 2);
  EXPECT_EQ(b.worker_clocks().at(2), 3);
  EXPECT_EQ(b.worker_clocks().at(3), 3);
}

// Quorum counts groups: a clock applies once q whole groups' parts are in, with the parts of
// every whole group and of no incomplete one, whose parts are then late together (and its ranks
// told the same clock to go on at). Two groups of 2 ({0, 1}, {2, 3}) and worker 4 alone, their
// parts interleaved.
TEST(Consistency, QuorumCountsWholeGroupsAndDropsALateGroupsPartsTogether) {
  ConsistencyRules r = rules(Consistency::Quorum, {0, 1, 2, 3, 4}, 2);
  EXPECT_EQ(r.push(0, 0, 0, 2), PushFate::Queued);
  EXPECT_EQ(r.push(2, 0, 20, 2), PushFate::Queued);
  EXPECT_EQ(r.push(3, 0, 30, 2), PushFate::Queued);  // one whole group of two needed
  EXPECT_FALSE(r.next_update());
  EXPECT_EQ(r.push(4, 0, 40, 1), PushFate::Ready);  // a worker alone is a whole group
  auto u = r.next_update();
  ASSERT_TRUE(u);
  EXPECT_EQ(u->workers, (std::vector<int64_t>{2, 3, 4}));  // not group {0, 1}'s part
  EXPECT_EQ(u->ids, (std::vector<int64_t>{20, 30, 40}));
  EXPECT_EQ(u->groups, (std::vector<int64_t>{2, 4}));
  // The incomplete group's part that came is freed with the clock, its other part is late.
  std::vector<int64_t> freed = r.applied(*u);
  std::sort(freed.begin(), freed.end());
  EXPECT_EQ(freed, (std::vector<int64_t>{0, 20, 30, 40}));
  EXPECT_EQ(r.push(1, 0, 10, 2), PushFate::Late);
  EXPECT_EQ(r.pending_pushes(), 0);
  EXPECT_EQ(r.pull_answered(0, 1), 1);
  EXPECT_EQ(r.pull_answered(1, 1), 1);
  // Clock 1: parts of both groups interleaved; once two groups are whole, all that are whole
  // apply (here both), in worker-index order.
  EXPECT_EQ(r.push(1, 1, 11, 2), PushFate::Queued);
  EXPECT_EQ(r.push(3, 1, 31, 2), PushFate::Queued);
  EXPECT_EQ(r.push(0, 1, 10, 2), PushFate::Queued);  // one whole group
  EXPECT_EQ(r.push(2, 1, 21, 2), PushFate::Ready);
  u = r.next_update();
  ASSERT_TRUE(u);
  EXPECT_EQ(u->workers, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(u->ids, (std::vector<int64_t>{10, 11, 21, 31}));
  r.applied(*u);
  EXPECT_EQ(r.push(4, 1, 41, 1), PushFate::Late);
}

// The quorum is capped by the active groups: with q = 2 and group {2, 3} lost, group {0, 1}
// alone applies the clock; a part alone never does.
TEST(Consistency, QuorumOfGroupsIsCappedByTheActiveGroups) {
  ConsistencyRules r = rules(Consistency::Quorum, {0, 1, 2, 3}, 2);
  r.push(0, 0, 0, 2);
  r.push(2, 0, 20, 2);
  r.push(1, 0, 1, 2);
  EXPECT_FALSE(r.next_update());
  r.set_active({0, 1, 3});  // rank 2 died, and with it its group (3 not yet declared)
  EXPECT_FALSE(r.next_update());
  r.set_active({0, 1});
  auto u = r.next_update();
  ASSERT_TRUE(u);
  EXPECT_EQ(u->ids, (std::vector<int64_t>{0, 1}));
}

TEST(SumPushes, SumsInTheGivenOrderAndRescalesToTheGlobalBatch) {
  // 1e8 + 1 − 1e8: the order decides whether the 1 survives in f32.
  const float a[1] = {1e8f}, b[1] = {1.0f}, c[1] = {-1e8f};
  float out[2];  // (2): the last case sums two values
  SumResult s = sum_pushes({{a, 2, 6, 1.0}, {b, 2, 6, 2.0}, {c, 2, 6, 3.0}}, 1, out);
  EXPECT_EQ(out[0], (1e8f + 1.0f) + -1e8f);
  EXPECT_EQ(s.rows, 6);
  EXPECT_DOUBLE_EQ(s.loss, 2.0);
  sum_pushes({{a, 2, 6, 0}, {c, 2, 6, 0}, {b, 2, 6, 0}}, 1, out);
  EXPECT_EQ(out[0], 1.0f);
  // Two of three workers' rows: the mean over the rows that came.
  const float g[2] = {0.5f, -1.0f};
  s = sum_pushes({{g, 2, 6, 4.0}, {g, 2, 6, 2.0}}, 2, out);
  EXPECT_EQ(out[0], 1.0f * (6.0f / 4.0f));
  EXPECT_EQ(out[1], -2.0f * (6.0f / 4.0f));
  EXPECT_EQ(s.rows, 4);
  EXPECT_DOUBLE_EQ(s.loss, 3.0);
}
