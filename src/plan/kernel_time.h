// The time of one kernel on a device model (plan/cluster.h), each formula once with its reason:
// the cost model (plan/cost_model.cpp) builds a step from these.
#pragma once
#include "core/dtype.h"
#include "plan/cluster.h"

namespace moetrain::plan {

// GEMM (M, N, K) at the device's rate for the operand type t.
double gemm_time(const DeviceModel& dev, DType t, double M, double N, double K);
// A Linear layer (M tokens, N outputs, K inputs): its forward and both halves of its backward.
double linear_fb_time(const DeviceModel& dev, DType t, double M, double N, double K);
// The peak FLOP/s of the operand type.
double peak_of(const DeviceModel& dev, DType t);
// An element-wise kernel moving `bytes`.
double stream_time(const DeviceModel& dev, double bytes);
// RMSNorm work moving `bytes`.
double norm_time(const DeviceModel& dev, double bytes);
// `count` RMSNorms of (N, C), forward + backward, elements of `ab` bytes.
double rmsnorm_time(const DeviceModel& dev, double N, double C, double count, double ab);

}  // namespace moetrain::plan
