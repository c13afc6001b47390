#include "plan/ablation.h"

#include <fmt/format.h>

namespace moetrain::plan {

std::vector<AblationRow> ablation(const RunConfig& cfg, const ClusterSpec& cluster,
                                  const Layout& layout, double zipf_s) {
  const int64_t E = cfg.model.n_experts;
  RunConfig base = cfg;
  base.dist.hierarchical = false;
  base.dist.a2a_chunks = 1;
  base.dist.overlap = false;
  base.dist.grad_reduce_dtype = "f32";
  auto balancing = [](RunConfig&, bool& uniform) { uniform = true; };
  auto communication = [](RunConfig& c, bool&) {
    c.dist.hierarchical = true;
    c.dist.a2a_chunks = 4;
  };
  auto gradients = [](RunConfig& c, bool&) {
    c.dist.overlap = true;
    c.dist.grad_reduce_dtype = "bf16";
  };
  struct Step {
    const char* name;
    const char* settings;
    std::vector<void (*)(RunConfig&, bool&)> changes;
  };
  const std::vector<Step> steps = {
      {"baseline", "zipf load, flat a2a, no overlap, f32 reduction", {}},
      {"+ balancing", "uniform load", {balancing}},
      {"+ communication", "dist.hierarchical, dist.a2a_chunks = 4", {communication}},
      {"+ gradients", "dist.overlap, dist.grad_reduce_dtype = bf16", {gradients}},
      {"all", "all of the above", {balancing, communication, gradients}},
  };
  std::vector<AblationRow> rows;
  for (const Step& st : steps) {
    RunConfig c = base;
    bool uniform = false;
    for (auto* change : st.changes) change(c, uniform);
    AblationRow r;
    r.name = st.name;
    r.settings = st.settings;
    r.prediction = predict(c, cluster, layout, uniform ? uniform_load(E) : zipf_load(E, zipf_s));
    rows.push_back(r);
  }
  rows.front().design_utilisation = 0.35;
  rows.front().design_comm_efficiency = 0.45;
  rows.front().design_samples_per_s = 125;
  rows.back().design_utilisation = 0.88;
  rows.back().design_comm_efficiency = 0.82;
  rows.back().design_samples_per_s = 312;
  return rows;
}

std::string format_ablation(const std::vector<AblationRow>& rows, int64_t seq_len) {
  auto design = [](double v, const char* f) {
    return v < 0 ? std::string("—") : fmt::format(fmt::runtime(f), v);
  };
  std::string out = fmt::format("{:<17}{:>14}{:>14}{:>22}  {}\n", "row", "utilisation", "comm eff.",
                                "samples/s", "changes");
  out += fmt::format("{:<17}{:>14}{:>14}{:>22}\n", "", "ours/design", "ours/design", "ours/design");
  for (const AblationRow& r : rows) {
    const Prediction& p = r.prediction;
    out += fmt::format(
        "{:<17}{:>14}{:>14}{:>22}  {}\n", r.name,
        fmt::format("{:.2f}/{}", p.utilisation, design(r.design_utilisation, "{:.2f}")),
        fmt::format("{:.2f}/{}", p.comm_efficiency, design(r.design_comm_efficiency, "{:.2f}")),
        fmt::format("{:.0f}/{}", p.tokens_per_s / static_cast<double>(seq_len),
                    design(r.design_samples_per_s, "{:.0f}")),
        r.settings);
  }
  const double gain = rows.back().prediction.tokens_per_s / rows.front().prediction.tokens_per_s;
  out += fmt::format("all / baseline throughput: ours {:.2f}×, the design's {:.2f}×\n", gain,
                     312.0 / 125.0);
  return out;
}

}  // namespace moetrain::plan
