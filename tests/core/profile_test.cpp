// The per-phase profile: exclusive time, nothing recorded when off, on another thread or inside
// an OpenMP parallel region (one that runs on one thread too), and the kernels' scopes land in
// their phase.
#include "core/profile.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <chrono>
#include <thread>
#include <vector>

#include "core/timer.h"
#include "kernels/norm.h"
#include "moe/experts.h"

namespace moetrain {
namespace {

void busy(double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
  }
}

const PhaseTotals& at(const PhaseTable& t, Phase p) {
  return t[static_cast<std::size_t>(p)];
}

TEST(Profile, NestedPhasesCountOnceInTheInnerPhase) {
  profile::start();
  Timer wall;
  {
    PhaseScope outer(Phase::Experts);
    busy(0.02);
    {
      PhaseScope inner(Phase::Convert);
      busy(0.03);
    }
  }
  const double wall_s = wall.seconds();
  const PhaseTable t = profile::stop();
  EXPECT_EQ(at(t, Phase::Experts).calls, 1);
  EXPECT_EQ(at(t, Phase::Convert).calls, 1);
  EXPECT_GE(at(t, Phase::Convert).seconds, 0.03);
  EXPECT_GE(at(t, Phase::Experts).seconds, 0.02);
  // Counted once: the two phases together fit in the wall time (inclusive time would not).
  EXPECT_LE(at(t, Phase::Experts).seconds + at(t, Phase::Convert).seconds, wall_s);
}

TEST(Profile, RecordsNothingWhenOffOrOnAnotherThreadOrInsideParallelRegions) {
  {
    PhaseScope off(Phase::Norm);
    busy(0.001);
  }
  profile::start();
  std::thread other([] {
    PhaseScope s(Phase::Rope);
    busy(0.001);
  });
  other.join();
#pragma omp parallel num_threads(2)
  {
    PhaseScope s(Phase::Router);
  }
  const PhaseTable t = profile::stop();
  EXPECT_EQ(at(t, Phase::Norm).calls, 0);
  EXPECT_EQ(at(t, Phase::Rope).calls, 0);
  EXPECT_EQ(at(t, Phase::Router).calls, 0);
}

// A parallel construct that runs on one thread (one thread in force, or its `if` false) is still
// a parallel region: what is entered inside counts in the phase around it, as with a team.
TEST(Profile, InsideASerialParallelRegionTheEnclosingPhaseKeepsTheTime) {
  profile::start();
  {
    PhaseScope outer(Phase::Experts);
#pragma omp parallel for num_threads(1)
    for (int i = 0; i < 2; ++i) {
      PhaseScope inner(Phase::Gemm);
      busy(0.005);
    }
#pragma omp parallel for if (false)
    for (int i = 0; i < 2; ++i) {
      PhaseScope inner(Phase::Activation);
      busy(0.005);
    }
  }
  const PhaseTable t = profile::stop();
  EXPECT_EQ(at(t, Phase::Gemm).calls, 0);
  EXPECT_EQ(at(t, Phase::Activation).calls, 0);
  EXPECT_EQ(at(t, Phase::Experts).calls, 1);
  EXPECT_GE(at(t, Phase::Experts).seconds, 0.02);
}

// The experts' GEMMs and SwiGLU count as the experts' phase whatever the thread count.
TEST(Profile, ExpertsKeepTheirGemmsOnOneThread) {
  const int64_t C = 64, F = 128, G = 2;
  std::vector<float> w1(G * F * C, 0.01f), w3(w1), w2(w1), xp(2 * 64 * C, 0.5f), y(xp.size());
  std::vector<int64_t> counts = {64, 64};
  ExpertRange w;
  w.first = 0, w.count = G, w.w1 = w1.data(), w.w3 = w3.data(), w.w2 = w2.data();
  ExpertActs acts;
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  profile::start();
  experts_forward(y.data(), xp.data(), counts.data(), w, C, F, acts);
  const PhaseTable t = profile::stop();
  omp_set_num_threads(threads);
  EXPECT_EQ(at(t, Phase::Experts).calls, 1);
  EXPECT_EQ(at(t, Phase::Gemm).calls, 0);
  EXPECT_EQ(at(t, Phase::Activation).calls, 0);
}

TEST(Profile, KernelsRecordTheirPhase) {
  const int64_t N = 4, C = 8;
  std::vector<float> out(N * C), rstd(N), inp(N * C, 1.0f), w(C, 1.0f);
  profile::start();
  rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, 1e-5f);
  const PhaseTable t = profile::stop();
  EXPECT_EQ(at(t, Phase::Norm).calls, 1);
  EXPECT_EQ(at(t, Phase::Gemm).calls, 0);
  EXPECT_STRNE(std::string(phase_name(Phase::Norm)).c_str(), "?");
}

}  // namespace
}  // namespace moetrain
