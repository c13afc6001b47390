// The time of one kernel on a device model: GEMMs, a linear layer's forward and backward,
// element-wise streams and RMSNorm (plan/kernel_time.h).
#include "plan/kernel_time.h"

#include <algorithm>
#include <cmath>

namespace moetrain::plan {

// GEMM (M, N, K): 2·M·N·K FLOPs at the device's peak for the operand type, slowed by the shape
// efficiency d / (d + gemm_small_dim) with d the smallest side (a GEMM thinner than the kernel's
// register/tensor-core tile wastes the rest of the tile and cannot amortise loading its operands),
// plus the fixed cost of one call. Written as flops/peak · (1 + small/d) + call.
double gemm_time(const DeviceModel& dev, DType t, double M, double N, double K) {
  if (M <= 0 || N <= 0 || K <= 0) return 0;
  // A measured table (this CPU): the rate at the nearest measured smallest sides, interpolated
  // in log d, because GEMM efficiency grows roughly with the logarithm of the thin side there.
  const bool lp = t != DType::F32 && !dev.gemm_bf16_dims.empty();
  const auto& dims = lp ? dev.gemm_bf16_dims : dev.gemm_f32_dims;
  const auto& rates = lp ? dev.gemm_bf16_flops : dev.gemm_f32_flops;
  if (!dims.empty()) {
    const double d = std::min({M, N, K});
    double rate = rates.front();
    if (d >= dims.back()) {
      rate = rates.back();
    } else if (d > dims.front()) {
      const std::size_t i =
          static_cast<std::size_t>(std::upper_bound(dims.begin(), dims.end(), d) - dims.begin());
      const double w = std::log(d / dims[i - 1]) / std::log(dims[i] / dims[i - 1]);
      rate = rates[i - 1] + w * (rates[i] - rates[i - 1]);
    }
    return 2 * M * N * K / rate;
  }
  const double peak =
      (t != DType::F32 && dev.peak_flops_bf16 > 0 ? dev.peak_flops_bf16 : dev.peak_flops_f32) *
      dev.gemm_max_efficiency;
  const double d = std::min({M, N, K});
  return 2 * M * N * K / peak * (1 + dev.gemm_small_dim / d) + dev.gemm_call_s;
}

// A Linear layer's forward (M, N, K) and its backward: the input gradient (M, K, N) and the
// weight gradient (N, K, M) — the same FLOPs each, so backward = 2× forward, but at their own
// shapes (a weight gradient reduces over the tokens).
// Where the profile timed this very layer (plan/kernel_table.h), that time instead: a small
// layer's three calls cost more than their FLOPs at any curve's rate.
double linear_fb_time(const DeviceModel& dev, DType t, double M, double N, double K) {
  if (const auto s = dev.kernels.find("linear", {M, K, N, dtype_code(t)})) return *s;
  return gemm_time(dev, t, M, N, K) + gemm_time(dev, t, M, K, N) + gemm_time(dev, t, N, K, M);
}

// The peak of the operand type: bf16/fp16 on tensor cores where the device has them.
double peak_of(const DeviceModel& dev, DType t) {
  return t != DType::F32 && dev.peak_flops_bf16 > 0 ? dev.peak_flops_bf16 : dev.peak_flops_f32;
}

// Element-wise kernels are bound by memory traffic: bytes moved / bandwidth.
double stream_time(const DeviceModel& dev, double bytes) {
  return bytes / dev.memory_bandwidth;
}

// RMSNorm at its own measured rate where the profile has one.
double norm_time(const DeviceModel& dev, double bytes) {
  return bytes / (dev.norm_bandwidth > 0 ? dev.norm_bandwidth : dev.memory_bandwidth);
}

// `count` RMSNorms of (N, C), forward + backward: as timed at this shape, or 3 · 2 · N · C
// elements of `ab` bytes at the norm's rate.
double rmsnorm_time(const DeviceModel& dev, double N, double C, double count, double ab) {
  if (const auto s = dev.kernels.find("norm", {N, C})) return count * *s;
  return norm_time(dev, count * 3 * 2 * ab * N * C);
}

}  // namespace moetrain::plan
