#include "plan/ablation.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "plan/load_model.h"

namespace moetrain::plan {

const std::vector<DesignRow>& design_ablation() {
  static const std::vector<DesignRow> rows = {
      {0.35, 0.45, 125}, {0.82, 0.45, 183}, {0.82, 0.78, 256}, {0.85, 0.78, 287}, {0.88, 0.82, 312}};
  return rows;
}

Prediction predict_adaptive(const RunConfig& cfg, const ClusterSpec& cluster, const Layout& layout,
                            const LoadModel& load) {
  RunConfig flat = cfg, hier = cfg;
  flat.dist.hierarchical = false;
  hier.dist.hierarchical = true;
  const Prediction f = predict(flat, cluster, layout, load);
  const Prediction h = predict(hier, cluster, layout, load);
  return h.step_time_s < f.step_time_s ? h : f;
}

double comm_efficiency_exposed(const StepParts& s) {
  const double compute = s.compute();
  return compute / (compute + s.a2a_exposed + s.grad_sync_exposed + s.tensor_parallel + s.sync);
}

double comm_efficiency_all(const StepParts& s) {
  const double compute = s.compute();
  return compute / (compute + s.a2a + s.grad_sync + s.tensor_parallel + s.sync);
}

std::vector<AblationRow> ablation(const RunConfig& cfg, const ClusterSpec& cluster,
                                  const Layout& layout, double zipf_s) {
  struct Step {
    const char* name;
    std::vector<std::string> added;
    const char* load;  // nullptr: the previous row's
    bool adaptive;
  };
  const std::string zipf = fmt::format("zipf:{}", zipf_s);
  const std::vector<Step> steps = {
      {"1 baseline",
       {"dist.hierarchical=false", "dist.a2a_chunks=1", "dist.a2a_dtype=f32", "dist.overlap=false",
        "dist.grad_reduce_dtype=f32", "grad.sparse_experts=false", "grad.expert_reweight=none",
        "placement.spare_slots=0"},
       zipf.c_str(),
       false},
      {"2 + load balancing", {}, "uniform", false},
      {"3 + communication",
       {"dist.hierarchical=true", "dist.a2a_chunks=4", "dist.a2a_dtype=bf16"},
       nullptr,
       false},
      {"4 + gradients",
       {"grad.sparse_experts=true", "grad.expert_reweight=importance",
        "dist.grad_reduce_dtype=int8", "dist.overlap=true"},
       nullptr,
       false},
      {"5 everything", {}, nullptr, true},
  };
  std::vector<AblationRow> rows;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const Step& st = steps[i];
    AblationRow r;
    r.name = st.name;
    r.added = st.added;
    if (!rows.empty()) r.settings = rows.back().settings;
    r.settings.insert(r.settings.end(), st.added.begin(), st.added.end());
    r.load = st.load ? st.load : rows.back().load;
    if (!rows.empty() && r.load != rows.back().load) r.added.push_back("load " + r.load);
    r.adaptive = st.adaptive || (!rows.empty() && rows.back().adaptive);
    if (st.adaptive) r.added.push_back("adaptive exchange (cheaper of flat and hierarchical)");
    const RunConfig c = with_overrides(cfg, r.settings);
    const LoadModel load = parse_load(r.load, cfg.model.n_experts);
    r.prediction = r.adaptive ? predict_adaptive(c, cluster, layout, load)
                              : predict(c, cluster, layout, load);
    r.design = design_ablation()[i];
    rows.push_back(std::move(r));
  }
  return rows;
}

std::string format_ablation(const std::vector<AblationRow>& rows, int64_t seq_len) {
  const double T = static_cast<double>(seq_len);
  const double base = rows.front().prediction.tokens_per_s / T;
  const double design_base = rows.front().design.samples_per_s;
  std::string out = fmt::format("{:<20}{:>18}{:>8}{:>24}{:>16}{:>14}\n", "", "utilisation",
                                "experts", "comm. efficiency", "samples/s", "× baseline");
  out += fmt::format("{:<20}{:>9}{:>9}{:>8}{:>8}{:>8}{:>8}{:>8}{:>8}{:>7}{:>7}\n", "row", "ours",
                     "design", "active", "exposed", "all", "design", "ours", "design", "ours",
                     "design");
  for (const AblationRow& r : rows) {
    const Prediction& p = r.prediction;
    const double sps = p.tokens_per_s / T;
    out += fmt::format(
        "{:<20}{:>9.2f}{:>9.2f}{:>8.2f}{:>8.2f}{:>8.2f}{:>8.2f}{:>8.0f}{:>8.0f}{:>7.2f}{:>7.2f}\n",
        r.name, p.utilisation, r.design.utilisation, p.experts_active,
        comm_efficiency_exposed(p.parts), comm_efficiency_all(p.parts), r.design.comm_efficiency,
        sps, r.design.samples_per_s, sps / base, r.design.samples_per_s / design_base);
  }
  out += "\nrows add, each on top of the previous one (a later value of a key replaces an earlier "
         "one):\n";
  for (const AblationRow& r : rows)
    out += fmt::format("  {}: {}{}\n", r.name, fmt::join(r.added, ", "),
                       r.adaptive ? fmt::format(" — ran {}", r.prediction.a2a_kind) : "");
  return out;
}

nlohmann::json ablation_json(const std::vector<AblationRow>& rows, int64_t seq_len) {
  const double T = static_cast<double>(seq_len);
  const double base = rows.front().prediction.tokens_per_s / T;
  nlohmann::json out = nlohmann::json::array();
  for (const AblationRow& r : rows) {
    nlohmann::json j = to_json(r.prediction);
    const double sps = r.prediction.tokens_per_s / T;
    j["row"] = r.name;
    j["added"] = r.added;
    j["settings"] = r.settings;
    j["load"] = r.load;
    j["adaptive_exchange"] = r.adaptive;
    j["samples_per_s"] = sps;
    j["ratio_to_baseline"] = sps / base;
    j["comm_efficiency_exposed"] = comm_efficiency_exposed(r.prediction.parts);
    j["comm_efficiency_all"] = comm_efficiency_all(r.prediction.parts);
    j["design"] = {{"utilisation", r.design.utilisation},
                   {"comm_efficiency", r.design.comm_efficiency},
                   {"samples_per_s", r.design.samples_per_s},
                   {"ratio_to_baseline",
                    r.design.samples_per_s / rows.front().design.samples_per_s}};
    out.push_back(j);
  }
  return out;
}

}  // namespace moetrain::plan
