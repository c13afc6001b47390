// Expert loads for the planner (uniform and Zipf: plan/cost_model.h), and measured ones: the
// tokens_per_expert of a run's metrics.jsonl.
#pragma once
#include <string>
#include <vector>

#include "plan/cost_model.h"

namespace moetrain::plan {

// Each step's tokens per expert, (steps, layers, E): the per-layer fractions summed over the
// steps, and each step's own (LoadModel::steps; a step in which a layer routed nothing is left
// out). Throws, naming `where`, when there is no step or a layer routed nothing over them all.
LoadModel measured_load(const std::vector<std::vector<std::vector<double>>>& counts,
                        const std::string& where);
// The same from every step line of RUN_DIR/metrics.jsonl (read with io/metrics read_metrics).
// Throws when the run has no tokens_per_expert or its expert count is not E.
LoadModel measured_load(const std::string& run_dir, int64_t E);
// "uniform", "zipf:S" or "metrics:RUN_DIR".
LoadModel parse_load(const std::string& spec, int64_t E);

}  // namespace moetrain::plan
