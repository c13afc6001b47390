// The design's ablation at scale: five cumulative rows (baseline; + load balancing;
// + communication; + gradients; everything), each predicted by the cost model on one cluster and
// printed beside the design's own figures (docs/plan.md, "The 1024-A100 ablation").
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "plan/cost_model.h"

namespace moetrain::plan {

// The design's figures for one row (1024 A100).
struct DesignRow {
  double utilisation, comm_efficiency, samples_per_s;
};
// Its five rows: 0.35/0.45/125, 0.82/0.45/183, 0.82/0.78/256, 0.85/0.78/287, 0.88/0.82/312.
const std::vector<DesignRow>& design_ablation();

struct AblationRow {
  std::string name;                // 1 baseline, 2 + load balancing, ...
  std::vector<std::string> added;  // what this row adds to the previous one
  // Everything the row runs with, as --set takes it, applied in order on top of the config
  // (a later value of a key replaces an earlier one): the previous row's settings and then its
  // own, so each row's list begins with the previous row's.
  std::vector<std::string> settings;
  std::string load;       // the load model, as --load takes it (zipf:S or uniform)
  bool adaptive = false;  // the exchange is the cheaper of flat and hierarchical (predict_adaptive)
  Prediction prediction;
  DesignRow design{};
};

// Adaptive routing of the exchange (dist.adaptive_route): the prediction with the cheaper of the
// flat and the hierarchical all-to-all. Its probes (every dist.route_probe_every-th step on the
// dearer path) are left out (docs/plan.md says what they cost). The cluster file gives every
// node pair the same links, so choosing per node pair is choosing for the whole exchange; on a
// rail-optimised network (cluster.spine_bandwidth) the flat route's rows for other positions
// cross the spine and the 2-D route's do not.
Prediction predict_adaptive(const RunConfig& cfg, const ClusterSpec& cluster, const Layout& layout,
                            const LoadModel& load);

// Communication efficiency two ways: compute over compute plus the communication the step waits
// for (exposed all-to-all and reduction, TP all-reduces, small collectives), and over compute
// plus all of it (hidden or not).
double comm_efficiency_exposed(const StepParts& s);
double comm_efficiency_all(const StepParts& s);

// Row 1, baseline: load zipf:S (hot experts together), flat all-to-all in one piece in f32,
// f32 gradient reduction after backward, dense expert gradients, no reweighting. Row 2 + load
// balancing: the balanced (uniform) load. Row 3 + communication: dist.hierarchical, 4 chunks
// overlapped with the experts, bf16 payloads. Row 4 + gradients: grad.sparse_experts,
// grad.expert_reweight = importance, int8 reduction overlapped with backward. Row 5 everything:
// row 4 with the adaptive exchange.
std::vector<AblationRow> ablation(const RunConfig& cfg, const ClusterSpec& cluster,
                                  const Layout& layout, double zipf_s);
std::string format_ablation(const std::vector<AblationRow>& rows, int64_t seq_len);
nlohmann::json ablation_json(const std::vector<AblationRow>& rows, int64_t seq_len);

}  // namespace moetrain::plan
