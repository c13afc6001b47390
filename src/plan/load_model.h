// Measured expert loads for the planner: the tokens_per_expert of a run's metrics.jsonl.
#pragma once
#include <string>

#include "plan/cost_model.h"

namespace moetrain::plan {

// The per-layer expert fractions summed over every step line of RUN_DIR/metrics.jsonl (read with
// io/metrics read_metrics), and each step's own (LoadModel::steps). Throws when the run has no tokens_per_expert or its expert count is
// not E.
LoadModel measured_load(const std::string& run_dir, int64_t E);
// "uniform", "zipf:S" or "metrics:RUN_DIR".
LoadModel parse_load(const std::string& spec, int64_t E);

}  // namespace moetrain::plan
