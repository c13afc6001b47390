#include "plan/load_model.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/metrics.h"

namespace moetrain::plan {

LoadModel uniform_load(int64_t E) {
  return {"uniform", {std::vector<double>(static_cast<std::size_t>(E), 1.0 / E)}, {}};
}

LoadModel zipf_load(int64_t E, double s) {
  MOETRAIN_CHECK(s >= 0 && std::isfinite(s), "zipf s = {}: must be ≥ 0", s);
  std::vector<double> p(static_cast<std::size_t>(E));
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += p[e] = 1.0 / std::pow(e + 1.0, s);
  for (double& v : p) v /= sum;
  return {"zipf", {p}, {}};
}

LoadModel measured_load(const std::vector<std::vector<std::vector<double>>>& counts,
                        const std::string& where) {
  LoadModel lm{"measured", {}, {}};
  for (const auto& layers : counts) {
    if (lm.fractions.empty()) {
      lm.fractions.resize(layers.size());
      for (std::size_t l = 0; l < layers.size(); ++l)
        lm.fractions[l].assign(layers[l].size(), 0.0);
    }
    MOETRAIN_CHECK(layers.size() == lm.fractions.size(),
                   "{}: tokens_per_expert changes its layer count", where);
    std::vector<std::vector<double>> step = layers;
    bool routed = true;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      double sum = 0;
      for (std::size_t e = 0; e < layers[l].size(); ++e) {
        lm.fractions[l][e] += layers[l][e];
        sum += layers[l][e];
      }
      routed = routed && sum > 0;
      for (double& v : step[l]) v /= sum > 0 ? sum : 1;
    }
    if (routed) lm.steps.push_back(std::move(step));
  }
  MOETRAIN_CHECK(!lm.fractions.empty(), "{}: no line with tokens_per_expert", where);
  for (auto& row : lm.fractions) {
    double sum = 0;
    for (double v : row) sum += v;
    MOETRAIN_CHECK(sum > 0, "{}: a layer routed no tokens", where);
    for (double& v : row) v /= sum;
  }
  return lm;
}

LoadModel measured_load(const std::string& run_dir, int64_t E) {
  std::vector<std::vector<std::vector<double>>> counts;
  for (const auto& line : read_metrics(run_dir)) {
    if (!line.contains("tokens_per_expert") || !line["tokens_per_expert"].is_array()) continue;
    const auto& layers = line["tokens_per_expert"];
    auto& step = counts.emplace_back();
    for (const auto& layer : layers) {
      MOETRAIN_CHECK(static_cast<int64_t>(layer.size()) == E,
                     "{}/metrics.jsonl: tokens_per_expert has {} experts per layer, the config "
                     "has model.n_experts = {}",
                     run_dir, layer.size(), E);
      auto& row = step.emplace_back();
      for (const auto& v : layer) row.push_back(v.get<double>());
    }
  }
  return measured_load(counts, run_dir + "/metrics.jsonl");
}

LoadModel parse_load(const std::string& spec, int64_t E) {
  if (spec == "uniform") return uniform_load(E);
  if (spec.rfind("zipf:", 0) == 0) {
    std::size_t used = 0;
    double s = -1;
    try {
      s = std::stod(spec.substr(5), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MOETRAIN_CHECK(used > 0 && used == spec.size() - 5, "--load {}: zipf:S needs a number S",
                   spec);
    return zipf_load(E, s);
  }
  if (spec.rfind("metrics:", 0) == 0) return measured_load(spec.substr(8), E);
  MOETRAIN_FAIL("--load {}: allowed are uniform, zipf:S, metrics:RUN_DIR", spec);
}

}  // namespace moetrain::plan
