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
// fractions were divided by A·W and sum to the mean. replicas > 0: the losses are divided by it
// instead of by the processes (pipeline stages hold parts of one loss, which sum).
void reduce_step_figures(Comm& comm, Accumulated& acc, int replicas = 0);

struct StepFigures {
  int64_t step = 0;                  // optimizer steps applied, this one included
  const Accumulated* acc = nullptr;  // reduced over processes
  double lr = 0, grad_norm = 0;
  const UpdateOutcome* update = nullptr;
  bool fp16 = false;            // the loss scale and the skip go into the line
  int64_t accuracy_rows = 0;    // > 0: the line holds accuracy = correct / accuracy_rows
  int64_t ep = 1;               // expert-parallel ranks the experts are sharded over
  int replicas = 0;             // > 0: the model's copies the losses are a mean over (pipeline)
};

// The reproducible part of the line: losses, lr, norm, expert loads; no wall-clock figures.
nlohmann::json step_metrics_line(const StepFigures& f);

// What a step's communication cost this process, measured where it ran: on the communication
// thread for overlapped work (its busy time, whatever the compute thread did meanwhile), on the
// compute thread otherwise. Communication = the expert all-to-alls, the gradient reduction and
// its gathers (ZeRO-1's parameter gather included).
struct CommParts {
  double step_s = 0;    // wall time of the step
  double thread_s = 0;  // the communication thread ran jobs (overlapped communication)
  double inline_s = 0;  // the compute thread communicated itself (nothing to hide it behind)
  // The compute thread was blocked on communication: its inline part and its waits for the
  // communication thread.
  double blocked_s = 0;
  int64_t bytes_a2a = 0;   // sent to other processes in the all-to-alls (forward and backward)
  int64_t bytes_grad = 0;  // sent by the gradient reduction and the gathers
  // Gradient computations of the step (micro-batches) and how many of them no update used: a
  // skipped fp16 step discards all of them; features that drop gradients (masked experts,
  // dropped pushes) add their share here.
  double grad_computations = 1;
  double grad_discarded = 0;
};

struct CommFigures {
  double total_s = 0;                // thread_s + inline_s
  double exposed_s = 0;              // blocked_s, at most total_s
  double compute_s = 0;              // step_s − exposed_s
  double comm_efficiency = 1;        // compute / (compute + exposed); 1 for an empty step
  double overlap_ratio = 1;          // 1 − exposed / total; 1 when nothing was communicated
  double grad_accum_efficiency = 1;  // (computations − discarded) / computations
};
// (computations − discarded) / computations, in [0, 1]; 1 when nothing was computed.
double grad_accum_efficiency(double computations, double discarded);
// Exposed time is capped by the total: the compute thread's own hand-off around a call (a wake-up,
// a timer) is not communication. Without a communication thread, exposed = total exactly.
CommFigures comm_figures(const CommParts& p);
// Sets comm_total_s, comm_exposed_s, compute_s, bytes_a2a, bytes_grad, comm_efficiency,
// overlap_ratio and grad_accum_efficiency of a metrics line.
void add_comm_metrics(const CommParts& p, nlohmann::json& line);

}  // namespace moetrain
