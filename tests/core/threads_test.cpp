#include "core/threads.h"

#include <gtest/gtest.h>
#include <omp.h>
#include <sched.h>

#include <cstdlib>
#include <set>
#include <vector>

using namespace moetrain;

namespace {

cpu_set_t process_mask() {
  cpu_set_t m;
  CPU_ZERO(&m);
  EXPECT_EQ(sched_getaffinity(0, sizeof(m), &m), 0);
  return m;
}

// Each pool thread's mask, read inside a parallel region of `n` threads.
std::vector<cpu_set_t> thread_masks(int n) {
  std::vector<cpu_set_t> masks(n);
#pragma omp parallel num_threads(n)
  sched_getaffinity(0, sizeof(cpu_set_t), &masks[omp_get_thread_num()]);
  return masks;
}

// Runs `body` with the placement variables unset and the pool filling the process's mask,
// restoring both afterwards.
template <class F>
void with_full_pool(F&& body) {
  const int before = omp_get_max_threads();
  for (const char* v : {"OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"})
    ASSERT_EQ(std::getenv(v), nullptr) << v << " is set: this test needs the placement unset";
  const cpu_set_t mask = process_mask();
  const int cpus = CPU_COUNT(&mask);
  if (cpus < 2) GTEST_SKIP() << "this process may run on " << cpus << " CPU: nothing to pin";
  omp_set_num_threads(cpus);
  body(mask, cpus);
  unpin_threads();
  omp_set_num_threads(before);
}

}  // namespace

TEST(Threads, PinsEachPoolThreadToItsOwnCpuAndGivesTheMaskBack) {
  with_full_pool([](const cpu_set_t& mask, int cpus) {
    ASSERT_TRUE(pin_threads());
    std::set<int> used;
    for (const cpu_set_t& m : thread_masks(cpus)) {
      ASSERT_EQ(CPU_COUNT(&m), 1);
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &m)) {
          EXPECT_TRUE(CPU_ISSET(c, &mask)) << "CPU " << c << " is outside the process's mask";
          used.insert(c);
        }
    }
    EXPECT_EQ(static_cast<int>(used.size()), cpus) << "two threads share a CPU";
    unpin_threads();
    for (const cpu_set_t& m : thread_masks(cpus)) EXPECT_TRUE(CPU_EQUAL(&m, &mask));
  });
}

TEST(Threads, LeavesThePlacementToTheUserOrToAPoolThatDoesNotFillTheMask) {
  with_full_pool([](const cpu_set_t& mask, int cpus) {
    setenv("OMP_PROC_BIND", "false", 1);
    EXPECT_FALSE(pin_threads());
    unsetenv("OMP_PROC_BIND");
    omp_set_num_threads(cpus - 1);
    EXPECT_FALSE(pin_threads());
    for (const cpu_set_t& m : thread_masks(cpus - 1)) EXPECT_TRUE(CPU_EQUAL(&m, &mask));
  });
}
