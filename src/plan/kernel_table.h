// Kernels measured at one run's own shapes (`moetrain plan --calibrate -c CONFIG`): the seconds
// of one forward + backward of a kernel exactly as the model calls it, in a step's order (every
// forward, then every backward; plan/calibrate.cpp), by shape. A step of a
// small model is many small calls whose cost (primitive dispatch, packing, a parallel region
// each, a thin side the vector units cannot fill) no shape-free curve gets right; timing the
// calls themselves does. The cost model uses a row where the shape matches exactly and its
// general curves elsewhere.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace moetrain::plan {

// One kind's rows: the shape columns, then seconds (forward + backward of one call).
//  linear    (tokens, in, out, dtype): Linear forward, input gradient and weight gradient
//  attention (B, T, NH, NKV, HS): attention core forward + backward
//  experts   (C, F, rows, dtype): experts_forward + experts_backward of one expert at `rows`
//            rows per call; seconds per expert
//  norm      (N, C): RMSNorm forward + backward
//  rope      (N, heads, HS): RoPE forward + backward
//  optimizer (params, optimizer): zeroing, the clip's norm and the optimizer step over that
//            many parameters
// dtype: 1 = f32, 2 = bf16, 3 = fp16. optimizer: 1 = adamw, 2 = sgd, 3 = any other.
struct KernelTable {
  std::map<std::string, std::vector<std::vector<double>>> rows;

  void add(const std::string& kind, std::vector<double> shape, double seconds);
  // Seconds at exactly this shape, if measured.
  std::optional<double> find(const std::string& kind, const std::vector<double>& shape) const;
  // Experts: seconds of one expert's forward + backward at `rows` rows per call, interpolated in
  // log(rows) between the measured row counts of (C, F, dtype) in seconds per row (at the ends:
  // the nearest measured seconds per row); nullopt when that (C, F, dtype) was not measured.
  std::optional<double> experts(double C, double F, double rows, double dtype) const;
  // Seconds per parameter of the update of `optimizer` (the row with the most parameters).
  std::optional<double> update_per_param(double optimizer) const;
  void scale_time(double factor);  // every time × factor (a share of the cores)
  bool empty() const { return rows.empty(); }
};

double dtype_code(DType t);
double optimizer_code(const std::string& name);
// Shape columns each kind has (without the seconds); 0 for an unknown kind.
std::size_t kernel_columns(const std::string& kind);
const std::vector<std::string>& kernel_kinds();

}  // namespace moetrain::plan
