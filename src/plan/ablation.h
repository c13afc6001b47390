// The design's ablation at scale: a baseline and what each optimisation family adds, predicted by
// the cost model on one cluster (docs/plan.md, "The 1024-A100 ablation").
#pragma once
#include <string>
#include <vector>

#include "plan/cost_model.h"

namespace moetrain::plan {

struct AblationRow {
  std::string name;      // baseline, + balancing, + communication, + gradients, all
  std::string settings;  // what the row changes, in config keys and load models
  Prediction prediction;
  // The design's figures; negative where the design gives none (it gives the endpoints only).
  double design_utilisation = -1, design_comm_efficiency = -1, design_samples_per_s = -1;
};

// Baseline: Zipf load (s = zipf_s, hot experts together), flat all-to-all in one piece, gradient
// reduction in f32 after backward. + balancing: the balanced (uniform) load model. +
// communication: hierarchical all-to-all, 4 chunks overlapped with the experts. + gradients:
// bucketed reduction overlapped with backward, in bf16. all: every change at once.
std::vector<AblationRow> ablation(const RunConfig& cfg, const ClusterSpec& cluster,
                                  const Layout& layout, double zipf_s);
std::string format_ablation(const std::vector<AblationRow>& rows, int64_t seq_len);

}  // namespace moetrain::plan
