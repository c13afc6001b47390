// metrics_summary: how a metrics.jsonl line becomes TensorBoard values (io/metrics.h).
#include <algorithm>
#include <string>
#include <vector>

#include "io/metrics.h"

namespace moetrain {

namespace {

bool is_number_list(const nlohmann::json& v) {
  return v.is_array() && !v.empty() &&
         std::all_of(v.begin(), v.end(), [](const nlohmann::json& x) { return x.is_number(); });
}

bool is_number_table(const nlohmann::json& v) {
  return v.is_array() && !v.empty() && std::all_of(v.begin(), v.end(), is_number_list);
}

std::string layer_tag(const std::string& key, std::size_t layer) {
  return key + "/layer_" + std::to_string(layer);
}

// Counts per bucket as a histogram over the bucket index: bucket e holds the values e (its range
// [e, e+1)), so TensorBoard draws the buckets side by side in order.
Histogram index_histogram(const std::vector<double>& counts) {
  Histogram h;
  h.min = 0;
  h.max = static_cast<double>(counts.size()) - 1;
  for (std::size_t e = 0; e < counts.size(); ++e) {
    const double x = static_cast<double>(e);
    h.num += counts[e];
    h.sum += counts[e] * x;
    h.sum_squares += counts[e] * x * x;
    h.bucket_limit.push_back(x + 1);
  }
  h.bucket = counts;
  return h;
}

// The load figures of one layer's tokens per expert.
void add_load(const std::vector<double>& load, std::size_t layer, Summary& out) {
  double mx = 0, sum = 0, used = 0;
  for (double v : load) mx = std::max(mx, v), sum += v, used += v > 0 ? 1 : 0;
  const double n = static_cast<double>(load.size());
  out.add_scalar(layer_tag("expert_utilisation", layer), static_cast<float>(used / n));
  // As train/step_metrics' imbalance: 1 when the layer saw no tokens.
  out.add_scalar(layer_tag("max_mean_load", layer), static_cast<float>(sum > 0 ? mx * n / sum : 1));
}

}  // namespace

bool metrics_summary(const nlohmann::json& line, int64_t& step, Summary& out) {
  if (!line.is_object() || !line.contains("step") || !line["step"].is_number()) return false;
  step = line["step"].get<int64_t>();
  for (const auto& [key, v] : line.items()) {
    if (key == "step") continue;
    if (v.is_boolean()) {
      out.add_scalar(key, v.get<bool>() ? 1.0f : 0.0f);
    } else if (v.is_number()) {
      out.add_scalar(key, static_cast<float>(v.get<double>()));
    } else if (is_number_list(v) && (key == "rank_step_time_s" || key == "rank_compute_s")) {
      // One entry per rank: bucket r is rank r's value, so a straggler is the tall bar.
      out.add_histogram(key, index_histogram(v.get<std::vector<double>>()));
    } else if (is_number_list(v)) {
      for (std::size_t i = 0; i < v.size(); ++i)
        out.add_scalar(layer_tag(key, i), static_cast<float>(v[i].get<double>()));
    } else if (is_number_table(v)) {
      for (std::size_t i = 0; i < v.size(); ++i) {
        const std::vector<double> row = v[i].get<std::vector<double>>();
        out.add_histogram(layer_tag(key, i), index_histogram(row));
        if (key == "tokens_per_expert") add_load(row, i, out);
      }
    }
  }
  return true;
}

}  // namespace moetrain
