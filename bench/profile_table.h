// The per-phase profile of a train step (core/profile.h) as the benchmarks print it: each phase's
// time per step, its share of the step and its calls per step, largest first, and what no phase
// covered.
#pragma once
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "core/profile.h"

namespace moetrain::bench {

inline void print_phase_table(const PhaseTable& table, int steps, double step_s) {
  std::printf("  %-26s %10s %7s %10s\n", "phase", "ms/step", "share", "calls/step");
  std::vector<int> order;
  double in_phases = 0;
  for (int i = 0; i < static_cast<int>(Phase::kCount); ++i) {
    order.push_back(i);
    in_phases += table[i].seconds;
  }
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return table[a].seconds > table[b].seconds; });
  for (int i : order) {
    if (table[i].calls == 0) continue;
    const double s = table[i].seconds / steps;
    std::printf("  %-26s %10.2f %6.1f%% %10.1f\n", std::string(phase_name(Phase(i))).c_str(),
                s * 1e3, 100.0 * s / step_s, static_cast<double>(table[i].calls) / steps);
  }
  const double other = step_s - in_phases / steps;
  std::printf("  %-26s %10.2f %6.1f%%\n", "(outside every phase)", other * 1e3,
              100.0 * other / step_s);
}

}  // namespace moetrain::bench
