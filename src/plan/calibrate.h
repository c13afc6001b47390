// Measures this machine for the planner, with the kernels training runs (kernels/gemm, the ones
// bench_gemm times; kernels/attention; kernels/norm): a few seconds, no training.
#pragma once
#include <string>

#include "plan/cluster.h"
#include "train/run_config.h"

namespace moetrain::plan {

struct Calibration {
  DeviceModel device;         // every thread in force
  DeviceModel single_thread;  // the same with one thread (a process among several)
  double copy_bandwidth = 0;  // bytes/s of a parallel stream copy (read + write)
  double intra_node_bandwidth = 0, intra_node_latency = 0;
};

// Measures with every thread in force (init_threads), then with one. Writes nothing.
// `bf16` = false skips the bf16 GEMMs (an f32 run needs none; the calibration takes about half
// as long, so that a test can calibrate right before each run it measures).
// `cfg` (may be null): also time the kernels of one micro-batch of that run at its own shapes
// (plan/kernel_table.h), which the cost model then prefers to its general curves.
Calibration calibrate(bool bf16 = true, const RunConfig* cfg = nullptr);

}  // namespace moetrain::plan
