// A stop signal that arrives while GEMMs run is counted, and the process stays whole: oneDNN's
// generated f32 GEMM kernels point the stack pointer into a heap workspace while they run (on
// AVX2 the x64 kernel does so for a K block past 252), so a handler run on a GEMM thread writes
// its frame over malloc's bookkeeping (stop_signal.cpp). Without the signals blocked on those
// threads, this test aborts on x64 ("corrupted size vs. prev_size", or a segmentation fault at a
// later free).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "kernels/gemm.h"
#include "train/stop_signal.h"

namespace moetrain {
namespace {

TEST(StopSignals, ASignalDuringGemmsIsCountedAndTheHeapStaysWhole) {
  // K past the kernels' stack capacity; every transposition, as the primitive picks its kernel by
  // layout.
  constexpr int64_t n = 48, K = 1024;
  std::vector<float> a(n * K, 0.5f), b(K * n, 0.25f), c(n * n);
  std::mt19937 rng(7);
  int64_t gemms = 0;
  for (int round = 0; round < 300; ++round) {
    clear_stop_signal();
    const StopSignals signals;
    const auto delay = std::chrono::microseconds(rng() % 3000);
    std::thread sender([delay] {
      std::this_thread::sleep_for(delay);
      ::kill(::getpid(), SIGTERM);  // to the process: the kernel picks the thread
    });
    for (int k = 0; stop_signal() == 0 && k < 200000; ++k, ++gemms) {
      gemm(k % 2 ? Trans::T : Trans::N, k / 2 % 2 ? Trans::T : Trans::N, n, n, K, a.data(),
           b.data(), c.data(), false);
      // Allocations of changing sizes between the GEMMs: malloc checks its neighbours' headers.
      const auto churn = std::make_unique<char[]>(static_cast<std::size_t>(64 + (k % 97) * 48));
      churn[0] = 1;
    }
    sender.join();
    ASSERT_EQ(stop_signal(), SIGTERM) << "round " << round;
  }
  clear_stop_signal();
  EXPECT_GT(gemms, 300);
  EXPECT_FLOAT_EQ(c[0], static_cast<float>(K) * 0.125f);
}

}  // namespace
}  // namespace moetrain
