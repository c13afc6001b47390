// A worker group through a server's death and the roll-back to the servers' checkpoint: every
// rank of the group goes back to the pull together (the ranks agree on the roll-back), and the
// replay of a sync job is exact.
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <string>
#include <vector>

#include "io/metrics.h"
#include "ps/group_job.h"  // tests/ps/group_job.h
#include "ps/process.h"    // tests/ps/process.h
#include "support/temp_dir.h"
#include "train/lm_checkpoint.h"

using namespace moetrain;
using namespace moetrain::testing;

TEST(PsGroupFault, AGroupRollsBackTogetherAndEndsAsTheUndisturbedJob) {
  TempDir tmp("ps_group_fault");
  const int steps = 40, batch = 2;
  const std::vector<std::string> job = {"--checkpoint-every", "10"};
  // Each step paced to a few times its compute, so that the kill lands mid-job.
  GroupJob ref(tmp.path(), "ref", 1, 2, steps, batch, {}, 2, job, "1", 4.0);
  ASSERT_EQ(ref.wait(150), 0) << ref.logs();
  GroupJob c(tmp.path(), "run", 1, 2, steps, batch, {}, 2, job, "1", 4.0);
  ASSERT_TRUE(wait_until([&] { return applied_steps(c.run) >= 15; }, 60)) << c.logs();
  c.servers[1]->kill(SIGKILL);
  ASSERT_LT(applied_steps(c.run), steps) << "the job ended before the kill";
  ASSERT_TRUE(wait_until(
      [&] { return c.scheduler->output().find("waiting up to") != std::string::npos; }, 30))
      << c.logs();
  c.add_server();
  ASSERT_EQ(c.wait(150), 0) << c.logs();
  EXPECT_EQ(read_json(c.run / "ps" / "scheduler.json")["rollbacks"].get<int64_t>(), 1)
      << c.logs();
  const std::vector<float> a = load_model(c.run).params, b = load_model(ref.run).params;
  ASSERT_EQ(a.size(), b.size());
  int64_t differ = 0;
  for (std::size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
  EXPECT_EQ(differ, 0) << "parameters differ from the undisturbed group job's";
}
