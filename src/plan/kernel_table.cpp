#include "plan/kernel_table.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace moetrain::plan {

const std::vector<std::string>& kernel_kinds() {
  static const std::vector<std::string> kinds = {"linear", "attention", "experts",
                                                 "norm",   "rope",      "optimizer"};
  return kinds;
}

std::size_t kernel_columns(const std::string& kind) {
  if (kind == "linear" || kind == "experts") return 4;
  if (kind == "attention") return 5;
  if (kind == "norm" || kind == "optimizer") return 2;
  if (kind == "rope") return 3;
  return 0;
}

double optimizer_code(const std::string& name) {
  return name == "adamw" ? 1 : name == "sgd" ? 2 : 3;
}

double dtype_code(DType t) {
  return t == DType::F32 ? 1 : t == DType::BF16 ? 2 : 3;
}

void KernelTable::add(const std::string& kind, std::vector<double> shape, double seconds) {
  MOETRAIN_CHECK(kernel_columns(kind) == shape.size(), "kernel table: {} takes {} shape columns",
                 kind, kernel_columns(kind));
  shape.push_back(seconds);
  auto& list = rows[kind];
  for (auto& r : list)
    if (std::equal(r.begin(), r.end() - 1, shape.begin())) {
      r = shape;
      return;
    }
  list.push_back(std::move(shape));
}

std::optional<double> KernelTable::find(const std::string& kind,
                                        const std::vector<double>& shape) const {
  const auto it = rows.find(kind);
  if (it == rows.end()) return std::nullopt;
  for (const auto& r : it->second)
    if (r.size() == shape.size() + 1 && std::equal(shape.begin(), shape.end(), r.begin()))
      return r.back();
  return std::nullopt;
}

std::optional<double> KernelTable::experts(double C, double F, double n, double dtype) const {
  if (n <= 0) return 0.0;
  const auto it = rows.find("experts");
  if (it == rows.end()) return std::nullopt;
  std::vector<std::pair<double, double>> per_row;  // (rows, seconds per row), rows ascending
  for (const auto& r : it->second)
    if (r[0] == C && r[1] == F && r[3] == dtype) per_row.emplace_back(r[2], r[4] / r[2]);
  if (per_row.empty()) return std::nullopt;
  std::sort(per_row.begin(), per_row.end());
  if (n <= per_row.front().first) return n * per_row.front().second;
  if (n >= per_row.back().first) return n * per_row.back().second;
  const auto hi = std::upper_bound(per_row.begin(), per_row.end(), std::make_pair(n, 0.0));
  const auto lo = hi - 1;
  const double w = std::log(n / lo->first) / std::log(hi->first / lo->first);
  return n * (lo->second + w * (hi->second - lo->second));
}

std::optional<double> KernelTable::update_per_param(double optimizer) const {
  const auto it = rows.find("optimizer");
  if (it == rows.end()) return std::nullopt;
  const std::vector<double>* best = nullptr;
  for (const auto& r : it->second)
    if (r[1] == optimizer && (best == nullptr || r[0] > (*best)[0])) best = &r;
  if (best == nullptr) return std::nullopt;
  return (*best)[2] / (*best)[0];
}

void KernelTable::scale_time(double factor) {
  for (auto& [kind, list] : rows)
    for (auto& r : list) r.back() *= factor;
}

}  // namespace moetrain::plan
