// The metrics line of a training step (what metrics.jsonl holds for it), built the same way by
// every trainer from the accumulated micro-batch figures and the update's outcome.
#pragma once
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm.h"
#include "optim/update.h"
#include "train/accumulate.h"

namespace moetrain {

// max load · E / Σ load (1 when nothing was routed or there are no experts).
double imbalance(const std::vector<int64_t>& load);

// Σ p·ln p over the load shares, divided by ln E: 1 = every expert equally loaded, 0 = one
// expert takes everything (also 0 with no tokens or one expert).
double load_entropy(const std::vector<int64_t>& load);
// The load of each of `ranks` expert-parallel shards (experts [q·E/P, (q+1)·E/P) on rank q).
std::vector<int64_t> rank_loads(const std::vector<int64_t>& load, int64_t ranks);
// Assignments computed / capacity slots of MoE layer m (1 when it had no slots).
double capacity_utilisation(const Accumulated& acc, std::size_t m);

// Collective over comm: the step's figures of every process summed into each. Every process's
// losses are means over the same number of rows, so their mean is the global one; the dropped
// fractions were divided by A·W and sum to the mean.
void reduce_step_figures(Comm& comm, Accumulated& acc);

struct StepFigures {
  int64_t step = 0;                  // optimizer steps applied, this one included
  const Accumulated* acc = nullptr;  // reduced over processes
  double lr = 0, grad_norm = 0;
  const UpdateOutcome* update = nullptr;
  bool fp16 = false;            // the loss scale and the skip go into the line
  int64_t grad_sync_bytes = 0;  // sent by this process during the step
  int64_t accuracy_rows = 0;    // > 0: the line holds accuracy = correct / accuracy_rows
  int64_t ep = 1;               // expert-parallel ranks the experts are sharded over
};

// The reproducible part of the line: losses, lr, norm, expert loads; no wall-clock figures.
nlohmann::json step_metrics_line(const StepFigures& f);

}  // namespace moetrain
