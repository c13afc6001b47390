#include "core/threads.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <vector>

#include "core/log.h"

namespace moetrain {

int hardware_cores() {
  return std::max(1u, std::thread::hardware_concurrency());
}

int init_threads(int requested, int local_processes) {
  int n = requested;
  if (n <= 0) {
    if (const char* env = std::getenv("OMP_NUM_THREADS"); env && std::atoi(env) > 0) {
      n = std::atoi(env);
    } else {
      n = std::max(1, hardware_cores() / std::max(1, local_processes));
    }
  }
  omp_set_num_threads(n);
  return n;
}

int num_threads() {
  return omp_get_max_threads();
}

namespace {
// The mask the process had before pin_threads (valid when g_pinned).
cpu_set_t g_mask;
bool g_pinned = false;
}  // namespace

bool pin_threads() {
  if (g_pinned) return true;
  for (const char* v : {"OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"})
    if (std::getenv(v)) return false;
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return false;
  const int n = num_threads();
  if (n < 2 || CPU_COUNT(&mask) != n) return false;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && static_cast<int>(cpus.size()) < n; ++c)
    if (CPU_ISSET(c, &mask)) cpus.push_back(c);
  int failed = 0;
#pragma omp parallel num_threads(n) reduction(+ : failed)
  {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[omp_get_thread_num()], &one);
    failed += sched_setaffinity(0, sizeof(one), &one) != 0;
  }
  g_mask = mask;
  g_pinned = true;
  if (failed > 0) {
    unpin_threads();
    return false;
  }
  log_info("threads pinned to cores");
  return true;
}

void unpin_threads() {
  if (!g_pinned) return;
#pragma omp parallel num_threads(num_threads())
  sched_setaffinity(0, sizeof(g_mask), &g_mask);
  g_pinned = false;
}

}  // namespace moetrain
