// The batch loaders: training windows shuffled per epoch and split over ranks, evaluation windows
// in order.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <set>
#include <vector>

#include "core/check.h"
#include "data/loader.h"
#include "data/shard.h"
#include "support/corpus.h"
#include "support/expect_error.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// One process of a layout: `world` ranks of B rows, `micro` micro-batches a step.
struct Layout {
  int world;
  int64_t B, micro;
  int64_t global() const { return world * B * micro; }
};

class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_ = scrambled_tokens(997);
    write_token_shard(dir_ / "train.bin", tokens_.data(), tokens_.size(), 256);
    shard_ = std::make_unique<TokenShard>(dir_ / "train.bin");
  }
  // Every row holds tokens [start, start+T) of a window at a multiple of T, and its targets are
  // the next tokens.
  void expect_windows(BatchLoader& l, int64_t step, int64_t micro, const std::vector<int32_t>& in,
                      const std::vector<int32_t>& tgt) {
    const int64_t B = l.batch(), T = l.seq_len();
    for (int64_t b = 0; b < B; ++b) {
      const uint64_t s = l.window_start(step, micro, b);
      ASSERT_EQ(s % T, 0u);
      ASSERT_LE(s + T + 1, tokens_.size());
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(in[b * T + t], tokens_[s + t]);
        ASSERT_EQ(tgt[b * T + t], tokens_[s + t + 1]);
      }
    }
  }
  static std::vector<uint64_t> starts(BatchLoader& l, int64_t step, int64_t micro) {
    std::vector<uint64_t> s;
    for (int64_t b = 0; b < l.batch(); ++b) s.push_back(l.window_start(step, micro, b));
    return s;
  }
  // The windows (start / T) of steps [from, to) of a run laid out as `lay`, every rank simulated by
  // its own loader, in the order of the global batch: micro-batch, then rank, then row.
  std::vector<int64_t> run_windows(const Layout& lay, int64_t T, uint64_t seed, int64_t from,
                                   int64_t to) {
    std::vector<std::unique_ptr<BatchLoader>> ranks;
    for (int r = 0; r < lay.world; ++r)
      ranks.push_back(
          std::make_unique<BatchLoader>(*shard_, lay.B, T, seed, r, lay.world, lay.micro));
    std::vector<int64_t> out;
    for (int64_t step = from; step < to; ++step)
      for (int64_t m = 0; m < lay.micro; ++m)
        for (auto& l : ranks)
          for (uint64_t s : starts(*l, step, m)) out.push_back(static_cast<int64_t>(s) / T);
    return out;
  }

  TempDir dir_{"loader"};
  std::vector<uint16_t> tokens_;
  std::unique_ptr<TokenShard> shard_;
};

// 997 tokens and T = 10: windows 0..98, window w = tokens [10w, 10w + 10].
constexpr int64_t kT = 10, kN = 99;

// Cut into epochs of N windows, the stream must be a permutation of all windows in each.
void expect_epochs_are_permutations(const std::vector<int64_t>& seen, int64_t epochs,
                                    const char* what) {
  ASSERT_GE(static_cast<int64_t>(seen.size()), epochs * kN) << what;
  for (int64_t e = 0; e < epochs; ++e) {
    std::vector<int> hits(kN, 0);
    for (int64_t i = e * kN; i < (e + 1) * kN; ++i) ++hits.at(static_cast<std::size_t>(seen[i]));
    for (int64_t w = 0; w < kN; ++w)
      ASSERT_EQ(hits[w], 1) << what << ": window " << w << " in epoch " << e;
  }
}

}  // namespace

TEST_F(LoaderTest, DeterministicWindowsAndShiftedTargets) {
  const int64_t B = 4, T = 16;
  BatchLoader a(*shard_, B, T, 1234, 0, 1, 2), b(*shard_, B, T, 1234, 0, 1, 2);
  EXPECT_EQ(a.stream().windows_per_epoch(), 996 / 16);
  std::vector<int32_t> in(B * T), tgt(B * T), in2(B * T), tgt2(B * T);
  // Out of order on purpose: a resumed run asks for step 7 first.
  b.fill(7, 1, in2.data(), tgt2.data());
  for (int64_t step = 0; step < 10; ++step) {
    for (int64_t micro = 0; micro < 2; ++micro) {
      a.fill(step, micro, in.data(), tgt.data());
      expect_windows(a, step, micro, in, tgt);
      if (step == 7 && micro == 1) {
        EXPECT_EQ(in, in2);
        EXPECT_EQ(tgt, tgt2);
      }
    }
  }
  EXPECT_EQ(starts(a, 3, 0), starts(b, 3, 0));
  EXPECT_NE(starts(a, 3, 0), starts(a, 4, 0));
  EXPECT_NE(starts(a, 3, 0), starts(a, 3, 1));
  BatchLoader other_seed(*shard_, B, T, 1235, 0, 1, 2);
  EXPECT_NE(starts(a, 3, 0), starts(other_seed, 3, 0));
}

// Every split of the same global batch reads the same windows at each step, in the order of the
// global batch (micro-batch, rank, row): so an MPI run reads what the one-process run reads, and a
// parameter-server worker's rows (any contiguous range, read through stream_position) too.
TEST_F(LoaderTest, AnySplitOfTheGlobalBatchReadsTheOneProcessWindows) {
  const int64_t G = 12, steps = 25;  // 300 windows: three epochs of 99 and a bit
  const std::vector<int64_t> one = run_windows({1, G, 1}, kT, 99, 0, steps);
  for (const Layout& lay : {Layout{2, 6, 1}, Layout{3, 4, 1}, Layout{2, 2, 3}, Layout{3, 2, 2},
                            Layout{1, 1, 12}, Layout{4, 3, 1}, Layout{6, 1, 2}}) {
    ASSERT_EQ(lay.global(), G);
    EXPECT_EQ(run_windows(lay, kT, 99, 0, steps), one)
        << lay.world << " ranks x " << lay.B << " rows x " << lay.micro << " micro-batches";
  }
  // Parameter-server workers: 6 rows a micro-batch, 2 micro-batches (G = 12), split unevenly
  // between two workers as rows [0, 2) and [2, 6).
  WindowStream stream(*shard_, kT, 99);
  std::vector<int64_t> workers;
  for (int64_t step = 0; step < steps; ++step)
    for (int64_t m = 0; m < 2; ++m)
      for (auto [begin, rows] : {std::pair<int64_t, int64_t>{0, 2}, {2, 4}})
        for (int64_t b = 0; b < rows; ++b)
          workers.push_back(
              static_cast<int64_t>(stream.window_start(stream_position(step, m, begin + b, 6, 2))) /
              kT);
  EXPECT_EQ(workers, one);
  // Ranks of a step read different windows.
  BatchLoader r0(*shard_, 4, kT, 99, 0, 2), r1(*shard_, 4, kT, 99, 1, 2);
  for (int64_t step : {0, 5, 123456}) {
    std::vector<uint64_t> s0 = starts(r0, step, 0), s1 = starts(r1, step, 0);
    std::set<uint64_t> both(s0.begin(), s0.end());
    both.insert(s1.begin(), s1.end());
    EXPECT_EQ(both.size(), 8u) << "step " << step;
  }
}

// The property the loader exists for: at 1, 2 and 3 ranks, with global batches that divide the
// epoch and that do not, the steps' global batches laid end to end read every window exactly once
// an epoch; each epoch in another order.
TEST_F(LoaderTest, AnEpochCoversEveryWindowOnceAcrossRanks) {
  for (const Layout& lay : {Layout{1, 4, 1}, Layout{1, 9, 1}, Layout{2, 3, 1}, Layout{2, 2, 3},
                            Layout{3, 3, 1}, Layout{3, 1, 11}, Layout{3, 5, 2}}) {
    const int64_t steps = (3 * kN + lay.global() - 1) / lay.global();
    const std::vector<int64_t> seen = run_windows(lay, kT, 5, 0, steps);
    const std::string what = std::to_string(lay.world) + " ranks x " + std::to_string(lay.B) +
                             " x " + std::to_string(lay.micro);
    expect_epochs_are_permutations(seen, 3, what.c_str());
    // The epochs differ in order, and none is the shard's order.
    const std::vector<int64_t> e0(seen.begin(), seen.begin() + kN),
        e1(seen.begin() + kN, seen.begin() + 2 * kN);
    EXPECT_NE(e0, e1) << what;
    std::vector<int64_t> in_order(kN);
    for (int64_t w = 0; w < kN; ++w) in_order[w] = w;
    EXPECT_NE(e0, in_order) << what;
  }
  // 99 = 11 steps of 9 windows: the ranks of each epoch's steps read it all, and nothing else.
  for (int world : {1, 3}) {
    const Layout lay{world, 9 / world, 1};
    for (int64_t e = 0; e < 3; ++e) {
      std::vector<int64_t> epoch = run_windows(lay, kT, 5, 11 * e, 11 * (e + 1));
      std::set<int64_t> distinct(epoch.begin(), epoch.end());
      EXPECT_EQ(epoch.size(), static_cast<std::size_t>(kN));
      EXPECT_EQ(distinct.size(), static_cast<std::size_t>(kN)) << world << " ranks, epoch " << e;
    }
  }
}

// The order is a function of (seed, epoch): another seed shuffles otherwise; any loader asked
// for an epoch first (a run resumed there) gives that epoch's order.
TEST_F(LoaderTest, EpochOrderIsAFunctionOfSeedAndEpoch) {
  WindowStream walked(*shard_, kT, 5), other_seed(*shard_, kT, 6);
  std::vector<int64_t> all, seed6;
  for (int64_t p = 0; p < 4 * kN; ++p) all.push_back(walked.window(p));
  for (int64_t p = 0; p < kN; ++p) seed6.push_back(other_seed.window(p));
  EXPECT_NE(std::vector<int64_t>(all.begin(), all.begin() + kN), seed6);
  WindowStream jumped(*shard_, kT, 5);
  for (int64_t p = 3 * kN + 40; p > 2 * kN; p -= 7) EXPECT_EQ(jumped.window(p), all[p]) << p;
  EXPECT_EQ(walked.epoch_of(3 * kN - 1), 2);
  EXPECT_EQ(walked.epoch_of(3 * kN), 3);
}

// A run stopped mid-epoch and resumed at its step reads from there exactly what the uninterrupted
// run reads — also when it resumes on another process count (the trainer keeps the global batch
// and changes the micro-batches), and the epochs stay whole.
TEST_F(LoaderTest, ResumeMidEpochContinuesWhereItStopped) {
  const int64_t steps = 30;  // 360 windows at G = 12
  const std::vector<int64_t> straight = run_windows({2, 2, 3}, kT, 11, 0, steps);
  for (int64_t stop : {4, 8, 13}) {  // 48 (epoch 0), 96 (epoch 0, 3 left), 156 (epoch 1)
    for (const Layout& after : {Layout{2, 2, 3}, Layout{1, 2, 6}, Layout{3, 2, 2}}) {
      std::vector<int64_t> resumed = run_windows({2, 2, 3}, kT, 11, 0, stop);
      const std::vector<int64_t> rest = run_windows(after, kT, 11, stop, steps);
      resumed.insert(resumed.end(), rest.begin(), rest.end());
      EXPECT_EQ(resumed, straight)
          << "stopped at step " << stop << ", resumed on " << after.world << " ranks";
      expect_epochs_are_permutations(resumed, 3, "resumed");
    }
  }
}

TEST_F(LoaderTest, SmallShardsWrapWithoutOverrunning) {
  std::vector<uint16_t> small = scrambled_tokens(21);
  write_token_shard(dir_ / "small.bin", small.data(), small.size(), 256);
  TokenShard shard(dir_ / "small.bin");
  // T = 5: windows at 0, 5, 10, 15 (the last needs tokens up to 20); a step of 8 rows reads two
  // epochs.
  BatchLoader l(shard, 8, 5, 7);
  EXPECT_EQ(l.stream().windows_per_epoch(), 4);
  for (int64_t step = 0; step < 20; ++step) {
    std::vector<uint64_t> s = starts(l, step, 0);
    for (int half = 0; half < 2; ++half)
      EXPECT_EQ(std::set<uint64_t>(s.begin() + 4 * half, s.begin() + 4 * half + 4),
                (std::set<uint64_t>{0, 5, 10, 15}))
          << "step " << step;
  }
  // Exactly one window of T+1 tokens: every row reads it.
  BatchLoader one(shard, 3, 20, 1);
  EXPECT_EQ(starts(one, 9, 0), (std::vector<uint64_t>{0, 0, 0}));
}

TEST_F(LoaderTest, RejectsBadLayouts) {
  expect_error([&] { BatchLoader(*shard_, 0, 8, 1); }, "B=0");
  expect_error([&] { BatchLoader(*shard_, 2, 0, 1); }, "T=0");
  expect_error([&] { BatchLoader(*shard_, 2, 8, 1, 2, 2); }, "rank 2 outside world of 2");
  expect_error([&] { BatchLoader(*shard_, 2, 997, 1); }, "fewer than one window");
  expect_error([&] { BatchLoader(*shard_, 2, 8, 1, 0, 1, 0); }, "0 micro-batches per step");
  expect_error([&] { WindowStream(*shard_, 997, 1); }, "fewer than one window");
  expect_error([&] { EvalLoader(*shard_, 2, 997); }, "fewer than one window");
  expect_error([&] { EvalLoader(*shard_, 2, 8, -1); }, "max_batches");
  BatchLoader l(*shard_, 2, 8, 1, 0, 1, 2);
  expect_error([&] { l.window_start(0, 0, 2); }, "row 2");
  expect_error([&] { l.window_start(-1, 0, 0); }, "step -1");
  expect_error([&] { l.window_start(0, 2, 0); }, "micro 2 (of 2)");
  expect_error([&] { stream_position(0, 0, 6, 6, 1); }, "row 6 of 6");
}

TEST_F(LoaderTest, EvalCoversEveryWindowOnce) {
  // 997 tokens, T = 10: windows 0..98 (window w needs tokens up to 10w + 10 ≤ 996).
  const int64_t T = 10;
  for (int world : {1, 2, 3}) {
    for (int64_t B : {1, 4, 7}) {
      std::vector<int> seen(99, 0);
      int64_t batches = -1;
      for (int rank = 0; rank < world; ++rank) {
        EvalLoader ev(*shard_, B, T, 0, rank, world);
        EXPECT_EQ(ev.num_windows(), 99);
        if (batches < 0) batches = ev.num_batches();
        EXPECT_EQ(ev.num_batches(), batches);  // same on every rank
        EXPECT_EQ(batches, (99 + B * world - 1) / (B * world));
        std::vector<int32_t> in(B * T, -5), tgt(B * T, -5);
        for (int64_t i = 0; i < ev.num_batches(); ++i) {
          int64_t rows = ev.fill(i, in.data(), tgt.data());
          ASSERT_GE(rows, 0);
          ASSERT_LE(rows, B);
          for (int64_t b = 0; b < rows; ++b) {
            // Find the row by content among all aligned windows (the scrambled tokens make it
            // unique).
            int64_t found = -1;
            for (int64_t w = 0; w < 99 && found < 0; ++w) {
              bool match = true;
              for (int64_t t = 0; t < T && match; ++t) {
                match =
                    in[b * T + t] == tokens_[w * T + t] && tgt[b * T + t] == tokens_[w * T + t + 1];
              }
              if (match) found = w;
            }
            ASSERT_GE(found, 0) << "row " << b << " of batch " << i << " is not an aligned window";
            ++seen[found];
          }
          for (int64_t j = rows * T; j < B * T; ++j) ASSERT_EQ(in[j], 0);
        }
      }
      for (int w = 0; w < 99; ++w)
        EXPECT_EQ(seen[w], 1) << "window " << w << " world " << world << " B " << B;
    }
  }
  EvalLoader capped(*shard_, 4, T, 3, 1, 2);
  EXPECT_EQ(capped.num_batches(), 3);
  EXPECT_EQ(capped.num_windows(), 24);
  EvalLoader all(*shard_, 4, T, 1000);
  EXPECT_EQ(all.num_windows(), 99);
  EXPECT_EQ(all.num_batches(), 25);
  std::vector<int32_t> in(40), tgt(40);
  EXPECT_EQ(all.fill(24, in.data(), tgt.data()), 3);
  expect_error([&] { all.fill(25, in.data(), tgt.data()); }, "batch 25");
}
