// Measures this machine for the planner, with the kernels training runs (kernels/gemm, the ones
// bench_gemm times; kernels/attention; kernels/norm): a few seconds, no training.
#pragma once
#include <string>

#include "plan/cluster.h"

namespace moetrain::plan {

struct Calibration {
  DeviceModel device;
  double copy_bandwidth = 0;  // bytes/s of a parallel stream copy (read + write)
  double intra_node_bandwidth = 0, intra_node_latency = 0;
  double fit_error = 0;  // worst relative error of the GEMM fit over the measured shapes
};

// Uses every thread in force (init_threads). Writes nothing.
Calibration calibrate();

}  // namespace moetrain::plan
