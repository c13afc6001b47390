// Parameter averaging as a parameter-server mode (--consistency average --local-steps H): each
// worker takes H optimizer steps of its own and pushes its parameters; the servers set their
// values to the row-weighted mean. One worker is then the single-process run (its H local steps
// per clock are the run's steps, the mean of one push is that push); two workers train, every
// clock applied once from both pushes.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "io/metrics.h"
#include "ps/process.h"  // tests/ps/process.h
#include "support/corpus.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

int launch(const TempDir& tmp, const std::string& run, std::vector<std::string> ps_args,
           int steps, int batch) {
  write_corpus(tmp / "data", 60000);
  std::vector<std::string> args = {"ps", "launch", "--timeout", "100"};
  args.insert(args.end(), ps_args.begin(), ps_args.end());
  args.insert(args.end(), {"--", "train"});
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp / "data", tmp / run, steps, batch)))
    args.push_back(s);
  Process p(args, tmp / (run + ".log"));
  const int code = p.wait(120);
  EXPECT_EQ(code, 0) << run << ":\n" << p.output();
  return code;
}

}  // namespace

// One worker, H = 3, 4 clocks over 2 servers: the single-process run of 12 steps, step for step
// (the same windows, the same check and AdamW step, its schedule over 12 steps); the servers'
// mean of one push of weight 1 is the push.
TEST(PsAverage, OneWorkerEqualsTheSingleProcessRun) {
  TempDir tmp("ps_average_one");
  const int H = 3, T = 4, B = 4;
  ASSERT_EQ(launch(tmp, "run",
                   {"--servers", "2", "--workers", "1", "--consistency", "average",
                    "--local-steps", std::to_string(H)},
                   T, B),
            0);
  RunConfig ref = load_run_config("", tiny_ps_overrides(tmp / "data", tmp / "ref", T * H, B));
  std::vector<float> ref_params;
  {
    Trainer t(ref, false);
    t.run();
    ref_params = t.params();
  }
  LoadedModel m = load_model(tmp / "run");
  EXPECT_EQ(m.step, T);
  ASSERT_EQ(m.params.size(), ref_params.size());
  const double d = relative_l2(m.params, ref_params);
  std::printf("average, one worker: relative L2 distance to the single-process run %.3g\n", d);
  EXPECT_LE(d, 1e-6);
  EXPECT_NEAR(val_loss(tmp / "run"), val_loss(tmp / "ref"), 1e-5);
}

// Two workers, H = 2, 10 clocks: every clock is one update from both workers' pushes (dense:
// parameters are never left out), and the averaged model trains: its validation loss is below
// the sync run's of the same 10 clocks (which took one optimizer step a clock, not two) and not
// below the sync run's of 20 clocks (the same windows, every step on the whole global batch).
TEST(PsAverage, TwoWorkersAverageEveryClockAndTrain) {
  TempDir tmp("ps_average_two");
  const int H = 2, T = 10, B = 4;
  ASSERT_EQ(launch(tmp, "avg",
                   {"--workers", "2", "--consistency", "average", "--local-steps",
                    std::to_string(H)},
                   T, B),
            0);
  ASSERT_EQ(launch(tmp, "sync", {"--workers", "2"}, T, B), 0);
  ASSERT_EQ(launch(tmp, "sync_long", {"--workers", "2"}, T * H, B), 0);
  const auto s = read_json(tmp / "avg" / "ps" / "server_0.json");
  EXPECT_EQ(s["updates"].get<int64_t>(), T);
  EXPECT_EQ(s["pushes"].get<int64_t>(), 2 * T);
  EXPECT_EQ(s["push_bytes"].get<int64_t>(), s["dense_push_bytes"].get<int64_t>());
  const double avg = val_loss(tmp / "avg"), sync = val_loss(tmp / "sync"),
               sync_long = val_loss(tmp / "sync_long");
  std::printf("val: average %.4f, sync %d clocks %.4f, sync %d clocks %.4f\n", avg, T, sync,
              T * H, sync_long);
  EXPECT_LT(avg, sync);
  EXPECT_GE(avg, sync_long - 0.02);
}
