#include "plan/load_model.h"

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/metrics.h"

namespace moetrain::plan {

LoadModel measured_load(const std::string& run_dir, int64_t E) {
  LoadModel lm{"measured", {}, {}};
  for (const auto& line : read_metrics(run_dir)) {
    if (!line.contains("tokens_per_expert") || !line["tokens_per_expert"].is_array()) continue;
    const auto& layers = line["tokens_per_expert"];
    if (lm.fractions.empty()) lm.fractions.assign(layers.size(), std::vector<double>(E, 0.0));
    MOETRAIN_CHECK(layers.size() == lm.fractions.size(),
                   "{}/metrics.jsonl: tokens_per_expert changes its layer count", run_dir);
    for (std::size_t l = 0; l < layers.size(); ++l) {
      MOETRAIN_CHECK(static_cast<int64_t>(layers[l].size()) == E,
                     "{}/metrics.jsonl: tokens_per_expert has {} experts per layer, the config "
                     "has model.n_experts = {}",
                     run_dir, layers[l].size(), E);
      for (int64_t e = 0; e < E; ++e) lm.fractions[l][e] += layers[l][e].get<double>();
    }
    std::vector<std::vector<double>> step(layers.size(), std::vector<double>(E));
    bool routed = true;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += step[l][e] = layers[l][e].get<double>();
      routed = routed && sum > 0;
      for (double& v : step[l]) v /= sum > 0 ? sum : 1;
    }
    if (routed) lm.steps.push_back(std::move(step));
  }
  MOETRAIN_CHECK(!lm.fractions.empty(), "{}/metrics.jsonl: no line with tokens_per_expert",
                 run_dir);
  for (auto& row : lm.fractions) {
    double sum = 0;
    for (double v : row) sum += v;
    MOETRAIN_CHECK(sum > 0, "{}/metrics.jsonl: a layer routed no tokens", run_dir);
    for (double& v : row) v /= sum;
  }
  return lm;
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
