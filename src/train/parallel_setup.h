// How a trainer spreads its work over processes, decided once at construction: the gradient
// reducer (local identity on one process, GradSync's buckets under MPI), the pieces of the flat
// buffer its optimizer updates (all of it; this rank's ZeRO-1 shard; or what it holds), and which
// rank writes each tensor into checkpoints.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/params.h"
#include "optim/grad_reducer.h"
#include "parallel/comm_thread.h"
#include "parallel/groups.h"
#include "parallel/sharded_optimizer.h"

namespace moetrain {

struct ReduceSettings {
  double bucket_first_mb = 1, bucket_mb = 25;
  std::string grad_reduce_dtype = "f32";
  bool zero1 = false;
  // Reduces gradient buckets during backward on this thread (null: after backward).
  CommThread* overlap = nullptr;
};

struct DataParallel {
  std::unique_ptr<GradReducer> reducer;
  std::vector<OptimPiece> pieces;  // what this rank's optimizer updates
  int64_t buckets = 0;             // gradient buckets (0 on one process)
  // Set as the model's grads-ready hook when buckets reduce during backward; empty otherwise.
  std::function<void(int64_t)> grads_ready;
};

// The parameters of `layout` held by this rank (all but other ranks' experts) reduced over
// groups.grads (replicated) and groups.expert_grads (experts). One process: the local reducer.
DataParallel make_data_parallel(const ParamTable& layout, const ExpertShard& held,
                                ProcessGroups& groups, const ReduceSettings& settings);

// Which rank writes each tensor of the layout (layout order) into checkpoints: an expert's, a rank
// of the EDP group that holds it (experts spread over its DP ranks); a replicated tensor, the
// rank with the fewest bytes so far, biggest tensors first, so that all ranks write about as much.
std::vector<int> checkpoint_writers(const ParamTable& layout, const ParallelLayout& pl, int64_t E);

}  // namespace moetrain
