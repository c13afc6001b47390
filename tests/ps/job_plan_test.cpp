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
