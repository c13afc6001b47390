// A parameter-server worker's computation, apart from its protocol (ps/worker.cpp): a full model
// replica computing the gradients of its rows of each step's global batch through the micro-batch
// accumulation routine every trainer uses (train/accumulate.h), weighted by their share of the
// global batch so that the servers' sum is the global mean; the experts that got no tokens (what
// a sparse push skips); and the lead worker's final checkpoint and validation.
//
// In a worker group (ps/worker.h) the replica is the group's: each rank's model holds its experts
// and runs the expert all-to-all over the group, as `moetrain train` under mpirun with dist.ep = P
// does (the MoE layers and the exchange are the same code). A rank's keys are its experts' key
// ranges plus its 1/P share of the dense keys (the dense key ranges, concatenated in layout order,
// cut into P chunks): after backward the group reduce-scatters the dense gradients (core/comm.h:
// rank q sums chunk q over the ranks in rank order), so a rank pushes only its keys; it pulls only
// them, and the group all-gathers the dense values before the next step.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/comm.h"
#include "data/loader.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "model/transformer.h"
#include "moe/capacity_controller.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "optim/sparse_experts.h"
#include "ps/codec.h"
#include "ps/kv_worker.h"
#include "ps/options.h"
#include "ps/worker.h"
#include "train/accumulate.h"
#include "train/expert_placement.h"
#include "train/run_config.h"

namespace moetrain::ps {

// Rows [row_begin, row_begin + rows) of each step's global batch of global_rows.
struct RowAssignment {
  int64_t row_begin = 0, rows = 0, global_rows = 0, epoch = 0;
};

class WorkerStep {
 public:
  // index: the worker's, named in errors. group: this rank's worker group (null: a replica alone).
  WorkerStep(const RunConfig& cfg, const PsOptions& opts, int64_t index,
             const WorkerGroup* group = nullptr);

  std::vector<float>& params() { return params_; }  // pulled from the servers
  std::vector<float>& grads() { return grads_; }    // what a push sends
  // The int8 error-feedback residual (empty without int8 pushes).
  std::vector<float>& residual() { return residual_; }
  // After compute with a sparse push: the expert tensors that got no tokens (sorted by offset);
  // in a group also every key that is not this rank's.
  const std::vector<Span>& skipped() const { return skip_; }
  // The keys this rank pulls (flat ranges, sorted): its experts and its dense share; null (every
  // key) for a replica alone.
  const std::vector<Span>* pull_keys() const { return group_ ? &keys_ : nullptr; }
  // Collective over the group, after a pull of pull_keys() told this rank to go on at `clock`:
  // the dense values gathered from every rank, and the clock the group goes on at (the latest any
  // rank was told: a rank must not compute a clock its group skips). Returns `clock` alone.
  // fresh: the first pull of a (re)start, after no compute of this process's or after a
  // roll-back undid it: hot-expert replicas take their owners' pulled weights without a re-plan.
  int64_t pulled(int64_t clock, bool fresh = false);

  // grads = the gradient of rows `a` of step `clock`, weighted by their share of the global
  // batch; the push's figures.
  PushMeta compute(int64_t clock, const RowAssignment& a);

  // average (--local-steps H): H optimizer steps on params, each on the mean gradient of rows `a`
  // of local step clock·H + h (the windows the single-process run with H·T steps reads there),
  // through the one check, clip and step of optim/update.h, with this worker's own optimizer
  // state; then grads = params × the rows' share of the global batch (what the servers sum into
  // the row-weighted mean). In a group a local step is the group's (the mean over its rows, the
  // dense gradients reduced over its ranks, the check and clip over its parts), and a rank pushes
  // its keys × the group's share. The figures: the mean loss over the H steps.
  PushMeta local_round(int64_t clock, const RowAssignment& a);

  // model.capacity = dynamic (ps/capacity_rounds.h): the figures of the last compute for the
  // scheduler's controllers, and the controllers' state it sends back, applied to the MoE layers
  // (apply_capacity_factors) before the next forward.
  const nlohmann::json& capacity_figures() const { return capacity_figures_; }
  void set_capacity(const nlohmann::json& state);
  // placement.spare_slots in a group of a sync job: the replicas follow the job's loads, which
  // the scheduler's round sums over every worker (its figures carry this rank's own); place()
  // re-plans from the loads of clock − 1 (MoE layers, E; empty: none decided, the replicas are
  // refreshed only) and refreshes the replicas. Collective over the group. Under the other modes
  // each group plans from its own loads after each pull.
  bool placed_by_scheduler() const;
  void place(int64_t clock, const nlohmann::json& loads);

  // The lead worker at the end of the job: params as a normal checkpoint of step `clock`, and
  // the validation loss written to the run's metrics.
  void finish(int64_t clock);

 private:
  const RunConfig& cfg_;
  const PsOptions& opts_;
  int64_t index_;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<TokenShard> train_;
  std::unique_ptr<WindowStream> windows_;  // the training windows in epoch order, over train_
  Tokenizer tokenizer_;  // data.dir's: its files go into the checkpoint
  std::vector<float> params_, grads_, residual_;
  std::vector<int32_t> inputs_, targets_;
  std::vector<Span> skip_;
  std::unique_ptr<Optimizer> opt_;         // average: this worker's optimizer over every key
  std::unique_ptr<LrSchedule> schedule_;   // average: over train.steps × H local steps
  std::unique_ptr<Comm> comm_;             // average: a local step's gradient is all of it
  std::vector<CapacityController> capacity_;  // model.capacity = dynamic: one per MoE layer
  nlohmann::json capacity_figures_;

  // grads = Σ over micro-batches of the gradient of rows `a` of step `step` × loss_weight; with
  // sigmoid_bias the router bias keys of grads = this worker's expert loads.
  Accumulated accumulate_rows(int64_t step, const RowAssignment& a, float loss_weight);
  void set_router_biases();
  void push_expert_loads();
  // grad.sparse_experts, utilisation reweighting: the recorder of each micro-batch's tokens per
  // expert (the trainers' own, fed by the accumulation routine) and the push of its record on the
  // expert count keys (expert_count_keys, ps/options.h).
  std::unique_ptr<SparseExperts> counts_;
  void push_expert_counts();

  // placement.spare_slots > 0 in a group: hot-expert replicas over the group's ranks, re-planned
  // from each clock's loads (the job's: place(); or the group's, summed over its ranks) once the
  // pull brought the owners' new weights, which then refresh the replicas
  // (train/expert_placement.h).
  std::unique_ptr<ExpertPlacement> placement_;
  std::vector<std::vector<int64_t>> placement_loads_;  // the group's, until the pull

  // A worker group: the dense key ranges (layout order), this rank's keys, the dense chunk sizes
  // per rank and this rank's chunk as flat ranges; dense_ holds the concatenated dense values.
  const WorkerGroup* group_ = nullptr;
  std::vector<Span> dense_keys_, keys_, chunk_keys_;
  std::vector<int64_t> chunk_counts_;
  std::vector<float> dense_, chunk_;
  void make_group_keys();
  // The group's gradients as this rank pushes them: the dense ones reduce-scattered, and skip_
  // every key not this rank's (and, with sparse pushes, its experts no rank routed a token to).
  void reduce_group(const Accumulated& acc);
};

}  // namespace moetrain::ps
