#include "core/threads.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

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

}  // namespace moetrain
