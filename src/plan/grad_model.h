// The gradient side of a step in the cost model: the reductions it runs (dense and expert
// gradients, ZeRO-3's weight gathers) on the wire dist.grad_reduce_dtype says, and the [grad]
// options that change what they carry: sparse expert gradients (grad.sparse_experts, whose mask
// also gives the design's expert utilisation, activated experts over all) and per-expert
// reweighting (grad.expert_reweight).
#pragma once
#include <cstdint>

#include "plan/cost_model.h"

namespace moetrain::plan {

// Parameters one process holds: the dense ones of its stage (and tensor shard, where tensor
// parallelism cuts the weights), its experts (and expert shard); and the ranks that reduce (and
// ZeRO-shard) each: the stage's data-parallel ranks and an expert shard's replicas, or, where
// every rank keeps whole weights (RankLayout::whole_params_under_tp, this trainer's tensor and
// expert tensor parallelism), every rank of the stage and every holder of the rank's experts.
struct LocalParams {
  double dense = 0, expert = 0;
  int64_t dense_ranks = 1, expert_ranks = 1;
};
LocalParams local_params(const ModelConfig& m, const RankLayout& l);

// Which experts a step touches under a load model. A token picks expert e with probability
// min(1, K·p_e) (p_e: e's share of the assignments), independently of the other tokens, so a
// micro-batch of G tokens over the whole run reaches e with q_e = 1 − (1 − min(1, K·p_e))^G; the
// step's mask keeps e when at least max(1, ⌈f·A⌉) of its A micro-batches reached it
// (f = grad.min_accum_fraction), a binomial tail. Layers share their load row as in predict; a
// measured load's mean fractions are used.
struct ExpertActivity {
  double per_microbatch = 1;  // mean q_e over layers and experts: activated / all experts
  double busiest_rank = 1;    // the EP rank with the most kept experts: its kept share
};
ExpertActivity expert_activity(const LoadModel& load, const ModelConfig& m, int64_t ep,
                               double tokens, int64_t microbatches, double min_accum_fraction);

// Appends the step's reductions to cm.reductions: dense gradients over local.dense_ranks, expert gradients over the expert's replicas (expert_share of them: the busiest rank's
// kept share under grad.sparse_experts, else 1), the copy of a reduction over a group of one,
// and ZeRO-3's weight gathers. Returns the bytes the reduction puts on the wire per process (for
// its buckets).
double add_reductions(const RunConfig& cfg, const ClusterSpec& cluster, const Layout& layout,
                      const LocalParams& local, double expert_share, CommBreakdown& cm);

// The step's update on one process: the parameters it steps (under ZeRO ≥ 1 its shards; under
// grad.sparse_experts only `kept`, the busiest rank's share, of its experts) and its seconds: as
// timed where the device's kernel table has this optimizer's update (zeroing and the clip's
// read included, 8 of its bytes per parameter), else at the bytes it moves; with
// grad.expert_reweight's pass.
struct UpdateCost {
  double updated = 0, seconds = 0;
};
UpdateCost update_cost(const RunConfig& cfg, const DeviceModel& dev, const LocalParams& local,
                       int64_t zero, double kept);

// Bytes grad.expert_reweight streams per step over `expert_params` gradients: importance and
// grad_norm read each gradient for their statistic, and every mode scales it (read and write);
// 0 for none.
double reweight_bytes(const std::string& mode, double expert_params);

}  // namespace moetrain::plan
