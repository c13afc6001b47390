// How a trainer spreads its work over processes, decided once at construction: the process
// groups, the experts this rank holds and the expert exchange its MoE layers run with, the gradient
// reducer (local identity on one process, GradSync's buckets under MPI), the pieces of the flat
// buffer its optimizer updates (all of it; this rank's ZeRO-1 shard; or what it holds), and which
// rank writes each tensor into checkpoints.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/page_buffer.h"
#include "model/params.h"
#include "parallel/reducer.h"
#include "parallel/comm_thread.h"
#include "parallel/grad_sync.h"
#include "parallel/groups.h"
#include "parallel/moe_exchange_setup.h"
#include "parallel/param_averaging.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/zero3_params.h"
#include "optim/sharded_optimizer.h"
#include "train/run_config.h"

namespace moetrain {

struct ReduceSettings {
  double bucket_first_mb = 1, bucket_mb = 25;
  std::string grad_reduce_dtype = "f32";
  int64_t zero = 0;  // dist.zero: 0, 1, 2 or 3
  // ZeRO-2 and 3: the flat gradient buffer, whose buckets it clears once reduced.
  PageBuffer* grad_buffer = nullptr;
  // ZeRO-3: the flat parameter buffer, and where the model's gather units begin in it
  // (TrainableModel::unit_starts).
  float* param_buffer = nullptr;
  std::vector<int64_t> unit_starts;
  bool local_steps = false;  // dist.sync = params: no gradient reduction, parameter averaging
  // Reduces gradient buckets during backward on this thread (null: after backward).
  CommThread* overlap = nullptr;
  // grad.sparse_experts: expert buckets cut per expert, so inactive ones can be skipped.
  bool sparse_experts = false;
  double sparse_ratio = 0;  // grad.sparse_ratio (0 = off)
  // dist.pp > 1: the stage's flat ranges, one per model chunk it holds (train/pipeline_step.h,
  // pipe_stage_params). Only their gradients are reduced, and their parameters stepped (ZeRO-1:
  // sharded over the stage's copies); the other stages' parts of this process's buffers are
  // never read.
  std::optional<std::vector<FlatRange>> stage;
  // Local steps of tensor-parallel copies (RunParallel::local): a copy's gradients are summed
  // over `copy`, its ranks, and its parameters averaged over `replicas`; null otherwise.
  Comm* copy = nullptr;
  Comm* replicas = nullptr;
};

// dist.sync = params with dist.tp > 1: a model copy is a tensor-parallel group, whose ranks each
// compute a share of its gradient. `grads` sums them (the copy's reduction), `check` agrees the
// copy's non-finite check and norm over its ranks' shards, and `replicas` averages the
// parameters over the ranks with this rank's tensor-parallel rank in every copy (the
// data-parallel replicas of the same shard).
struct LocalCopies {
  std::unique_ptr<Comm> grads, check, replicas;
};

// Where a process sits in a pipeline (dist.pp > 1; train/pipeline_step.h): world = replicas ×
// stages × dist.tp, rank r = (replica · stages + stage) · tp + t (t: the tensor-parallel rank).
struct PipeSetup {
  int64_t stages = 1, stage = 0;
  PipeSchedule schedule = PipeSchedule::OneFOneB;
  int64_t chunks_per_stage = 1;  // dist.vp: model chunks a stage (interleaved, zero_bubble)
  // The pipe's processes (rank q = stage q, all with this rank's t); null without stages.
  std::unique_ptr<Comm> comm;
  int64_t replica = 0, replicas = 1;  // the pipe among the data-parallel copies of the model
  // dist.tp > 1: the stage's tensor-parallel group (RunParallel::tp, which owns it), which every
  // activation slot's model computes with; null otherwise.
  Comm* tp = nullptr;
};

// The processes of a run and its experts over them (world = DP × dist.ep; with dist.pp > 1
// the groups are the stage's copies, every tensor-parallel rank of every pipeline, and `control`
// is the world).
struct RunParallel {
  std::unique_ptr<ProcessGroups> groups;
  ExpertShard experts;     // the experts this rank holds (every one on one process)
  ExpertParallelSetup ep;  // the expert exchange, its route and thread (empty on one process)
  PipeSetup pipe;
  // dist.tp > 1: this rank's tensor-parallel group (ranks tp·i … tp·i + tp − 1, a model's copy,
  // or under dist.pp a stage of it, run by tp processes on one batch; model/transformer.h), on
  // the communication thread when there is one; null otherwise.
  std::unique_ptr<Comm> tp;
  LocalCopies local;  // dist.sync = params with dist.tp > 1; empty otherwise
  // What the model's MoE layers run with: the exchange and statistics over every process holding
  // tokens, so balancing losses and capacities are the global batch's; local on one process.
  // Its pointers stay valid when the members are moved out.
  MoeContext moe_context();
};

// Collective over world. has_moe_layers = false keeps every expert on every rank (nothing to
// shard). dist.pp · dist.tp must divide the processes: world / (dist.pp · dist.tp) pipelines of
// dist.pp stages of dist.tp ranks.
RunParallel make_run_parallel(Comm& world, const DistSettings& dist, int64_t n_experts,
                              bool has_moe_layers);

struct DataParallel {
  std::unique_ptr<GradReducer> reducer;
  std::vector<OptimPiece> pieces;  // what this rank's optimizer updates
  int64_t buckets = 0;             // gradient buckets (0 on one process)
  // dist.sync = params under MPI: what averages the replicas (the reducer is then the local one).
  std::unique_ptr<ParamAverager> averager;
  // Set as the model's grads-ready hook when buckets reduce during backward; empty otherwise.
  std::function<void(int64_t)> grads_ready;
  // ZeRO-3 under MPI: the parameters' gathers, for the model's param units (it uses the reducer's
  // buckets: the reducer outlives it).
  std::unique_ptr<Zero3Params> zero3;
};

// The dist settings that shape the gradient reduction; comm_thread reduces buckets during backward
// when dist.overlap (null: after backward).
ReduceSettings reduce_settings(const DistSettings& dist, CommThread* comm_thread);

// The parameters of `layout` held by this rank (all but other ranks' experts; within the ranges
// of settings.stage when set) reduced over groups.grads (replicated) and groups.expert_grads
// (experts). One process: the local reducer.
DataParallel make_data_parallel(const ParamTable& layout, const ExpertShard& held,
                                ProcessGroups& groups, const ReduceSettings& settings);

// Which rank writes each tensor of the layout (layout order) into checkpoints: an expert's, a rank
// of the EDP group that holds it (experts spread over its DP ranks); a replicated tensor, the
// rank with the fewest bytes so far, biggest tensors first, so that all ranks write about as much.
std::vector<int> checkpoint_writers(const ParamTable& layout, const ParallelLayout& pl, int64_t E);

}  // namespace moetrain
