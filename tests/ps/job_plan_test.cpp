// The scheduler's socket-free decisions: the setup layout, capability weights, the roll-back
// clock, worker indices.
#include "ps/job_plan.h"

#include <gtest/gtest.h>

#include "ps/membership.h"

using namespace moetrain::ps;

TEST(JobPlan, NewestCommonClockIsTheNewestEveryServerHolds) {
  EXPECT_EQ(newest_common_clock({{0, {10, 20, 30}}, {1, {20, 30, 40}}, {2, {10, 20}}}), 20);
  EXPECT_EQ(newest_common_clock({{0, {10}}, {1, {20}}}), 0);  // the initialisation
  EXPECT_EQ(newest_common_clock({}), 0);
}

TEST(JobPlan, CapabilityWeightsWaitForEveryThroughput) {
  EXPECT_FALSE(capability_weights({2.0, 0.0}));
  EXPECT_EQ(capability_weights({2.0, 1.0}).value(), (std::vector<double>{2.0, 1.0}));
}

// Two groups of 2 (workers 0–3) and a worker alone (4). Group 1's rank 3 runs at 10 rows/s, so
// the group runs at 2 × 10 = 20 whatever its rank 2 could do; group 0 at 2 × 30 = 60; worker 4 at
// 20. Weights 60 : 20 : 20 of 50 rows: 30, 10, 10, each group's cut evenly over its ranks.
TEST(JobPlan, CapabilityWeighsAGroupByItsSlowestRank) {
  const std::vector<WorkerRate> w = {{0, 2, 30}, {1, 2, 40}, {2, 2, 50}, {3, 2, 10}, {4, 1, 20}};
  const auto split = split_rows_by_group(50, w, true).value();
  EXPECT_EQ(split.rows, (std::vector<int64_t>{15, 15, 5, 5, 10}));
  ASSERT_EQ(split.groups.size(), 3u);
  EXPECT_EQ(split.groups[0].indices, (std::vector<int64_t>{0, 1}));
  EXPECT_DOUBLE_EQ(split.groups[0].throughput, 60);
  EXPECT_DOUBLE_EQ(split.groups[1].throughput, 20);
  EXPECT_EQ(split.groups[1].rows, 10);
  EXPECT_EQ(split.groups[2].group, 4);
  // An odd share: the lower rank takes the remainder; unweighted, every worker the same.
  const auto odd = split_rows_by_group(7, {{0, 2, 1}, {1, 2, 1}}, true).value();
  EXPECT_EQ(odd.rows, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(split_rows_by_group(8, w, false).value().rows.size(), 5u);
  EXPECT_EQ(split_rows_by_group(10, w, false).value().rows,
            (std::vector<int64_t>{2, 2, 2, 2, 2}));
  // A group whose rank has not reported a rate yet: no split.
  EXPECT_FALSE(split_rows_by_group(50, {{0, 2, 30}, {1, 2, 0}}, true));
  // The record of a decision names the clock, the cause and each group's figures.
  const nlohmann::json r = assign_record(split, 12, "measured throughput");
  EXPECT_EQ(r["decision"], "assign");
  EXPECT_EQ(r["clock"], 12);
  EXPECT_EQ(r["groups"][1]["rows"], 10);
  EXPECT_EQ(r["groups"][1]["workers"], (nlohmann::json{2, 3}));
}

TEST(JobPlan, WorkersGetContiguousRowsInIndexOrder) {
  auto jw = setup_workers({0, 2, 3}, {4, 2, 2});
  ASSERT_EQ(jw.size(), 3u);
  EXPECT_EQ(jw[1]["index"], 2);
  EXPECT_EQ(jw[1]["row_begin"], 4);
  EXPECT_EQ(jw[2]["row_begin"], 6);
  auto js = setup_servers({{"tcp://a:1", ""}, {"", "tcp://b:2"}}, {{0, 16}, {16, 40}});
  EXPECT_EQ(js[1]["endpoint"], "");
  EXPECT_EQ(js[1]["backup"], "tcp://b:2");
  EXPECT_EQ(js[1]["begin"], 16);
}

TEST(Membership, ARestartedWorkerTakesTheLowestFreeIndexOrTheOneItAsksFor) {
  Membership m;
  for (int32_t id : {0, 1, 2}) {
    Node n;
    n.id = id;
    n.role = "worker";
    n.index = id;
    m.nodes()[id] = n;
  }
  m.nodes()[1].alive = false;
  EXPECT_EQ(m.free_worker_index(-1), 1);
  EXPECT_EQ(m.free_worker_index(5), 5);
  EXPECT_EQ(m.free_worker_index(2), 1);  // taken: the lowest free one
  EXPECT_EQ(m.alive_workers().size(), 2u);
}
