// A run's process layout for the planner, and whether a model and a cluster can take it.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "model/activation_bytes.h"
#include "model/config.h"
#include "moe/recompute.h"
#include "parallel/pipeline_schedule.h"
#include "plan/cluster.h"
#include "train/run_config.h"

namespace moetrain::plan {

// world = PP × TP × DP for the dense layers; the experts fold EP × ETP over the same TP × DP ranks
// of a stage (Megatron-Core's parallel folding): EP × ETP × EDP = TP × DP, the experts' layout
// chosen apart from the attention's (EP may exceed DP; ETP splits each expert's hidden size, as
// TP splits the attention's heads). Tensor (tp, etp) and pipeline (pp,
// with vp virtual stages per rank) parallelism are modelled simply (docs/plan.md), for published
// runs that use them; which layouts the trainer runs, its own validation says (planner_only).
struct Layout {
  int64_t procs = 1;
  int64_t ep = 1;
  int64_t tp = 1, pp = 1, vp = 1;
  // Expert tensor parallelism: each expert's hidden size (model.expert_hidden) split over etp
  // ranks, which all-gather the rows the expert exchange brought them and reduce-scatter the
  // experts' outputs (Megatron-Core's expert_tensor_parallel_size).
  int64_t etp = 1;
  // How the state and activations are kept. zero < 0: the config's dist.zero (the trainer runs
  // ZeRO 0–2; 3 is the planner's only). recompute: activation recomputation (moe/recompute.h),
  // unset: the config's train.recompute.
  int64_t zero = -1;
  std::optional<Recompute> recompute{};
  // Selective recomputation on top of none or moe (--recompute-modules layernorm,moe_act; model/
  // activation_bytes.h): the norms' outputs and the routed experts' activation outputs dropped
  // after the forward and recomputed element-wise in backward (planner only).
  RecomputeModules recompute_modules{};
  // The optimizer state (moments, and f32 master weights apart from the weights) in a host file
  // as dist.offload = host_file keeps it: out of the device bytes, the store's ring of chunks in
  // (optim/offload_store.h); its disk traffic is not timed. Unset: the config's dist.offload.
  std::optional<bool> offload{};
  // The expert exchange as DeepEP runs it (comm_model.h alltoall_dedup): each token crosses to a
  // node once and is fanned out there over NVLink (planner only).
  bool a2a_dedup = false;
  // Each micro-batch's exchanges run while another micro-batch computes (1F1B with all-to-all
  // overlap: Megatron-Core's overlap_moe_expert_parallel_comm, DeepSeek's DualPipe; planner only).
  bool a2a_overlap = false;
  // Megatron-Core's account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split
  // (--pp-account embedding,loss; planner only): the embedding (first stage) and the LM head with
  // its loss (last stage) each take a block's place where the blocks are cut into pp × vp
  // chunks, so model.n_layers plus the units set must divide by pp × vp (Qwen3-235B's 94 blocks
  // and both units: 8 stages × 4 chunks of 3).
  bool pp_embedding_unit = false, pp_loss_unit = false;
  int64_t pp_units(int64_t n_layers) const {
    return n_layers + (pp_embedding_unit ? 1 : 0) + (pp_loss_unit ? 1 : 0);
  }
  // Megatron-Core's decoder_first_pipeline_num_layers and decoder_last_pipeline_num_layers
  // (--pp-first-layers, --pp-last-layers; planner only): the first and the last stage hold this
  // many blocks (0: not set), the other stages share the remaining blocks evenly (DeepSeek-V3's
  // 61 blocks over 16 stages as 3, 14 × 4, 2). With --vp 1 and without --pp-account.
  int64_t pp_first_layers = 0, pp_last_layers = 0;
  bool pp_uneven() const { return pp_first_layers > 0 || pp_last_layers > 0; }
  // The pipeline schedule (parallel/pipeline_schedule.h); unset: interleaved with vp > 1, else
  // 1f1b.
  std::optional<PipeSchedule> schedule{};
  PipeSchedule pipe_schedule() const {
    return schedule.value_or(vp > 1 ? PipeSchedule::Interleaved : PipeSchedule::OneFOneB);
  }
  // Processes holding the same layers and tensor shard: the data-parallel world of one stage.
  int64_t stage() const { return procs / (tp * pp); }
  // Replicas of each expert shard (EDP): EP × ETP folds over the stage's tensor shards and
  // data-parallel ranks.
  int64_t dp() const { return procs / pp / (ep * etp); }
};

// The configuration `moetrain train` runs the layout with: cfg with dist.ep, dist.tp, dist.pp,
// dist.vp and dist.pp_schedule of the layout, its ZeRO stage (dist.zero), recomputation
// (train.recompute) and offload (dist.offload) where it sets them.
RunConfig trainer_config(const RunConfig& cfg, const Layout& l);
// Why `moetrain train` does not run this layout with this configuration, empty where it does:
// "planner only: moetrain train has no X yet" for what it has no key for (expert tensor
// parallelism, the deduplicated or overlapped all-to-all, selective recomputation), else the
// trainer's own refusal of trainer_config (RunConfig::validate, with validate_pipeline and
// validate_tensor_parallel; ModelConfig::check_trainable): "planner only: dist.tp = 2 with
// dist.pp = 2 (pipeline stages): tensor parallelism does not run it yet; ...". The same checks
// the trainer makes when it loads the configuration, so the two cannot disagree; what depends on
// the process count (train/parallel_setup.cpp) is layout_problem's.
std::string planner_only(const RunConfig& cfg, const Layout& l);
inline bool trainer_runs(const RunConfig& cfg, const Layout& l) {
  return planner_only(cfg, l).empty();
}

// "layernorm,moe_act" → both modules; "" → none. Any other name is refused, naming the value and
// the allowed names (`flag` names the option in the message).
RecomputeModules parse_recompute_modules(const std::string& list,
                                         const char* flag = "--recompute-modules");
// The pipeline stage that paces a step: its share of the model's layers and whether the LM head
// runs on it. Without --pp-account every stage runs L / pp layers and the last one the head too,
// which makes it the slowest (no layers are moved off it). Where the embedding and the loss take
// a block's place (Layout::pp_embedding_unit, pp_loss_unit), the stages hold U = (L + units) /
// pp: the first U − 1 blocks beside the embedding, the last U − 1 beside the LM head, the others
// U; the slowest of them paces (a middle stage where the head costs less than the block it
// displaces). Where the first or the last stage's blocks are set (Layout::pp_first_layers,
// pp_last_layers), those and the even share of the others, the slowest pacing likewise.
// `block` and `head`: one layer's and the head's time for a micro-batch.
struct PacingStage {
  double share = 1;  // of the n_layers
  bool head = true;
};
PacingStage pacing_stage(const Layout& layout, int64_t n_layers, double block, double head);

// "embedding,loss" → both of Layout's pipeline units; "" → none. Any other name is refused, naming
// the value and the allowed names.
void parse_pp_account(Layout& layout, const std::string& list, const char* flag = "--pp-account");
// The units as --pp-account takes them ("embedding,loss"; "" for none).
std::string pp_account_name(const Layout& layout);
// The pipeline's blocks a stage, first / middle / last ("3/4/2"), where they are uneven
// (Layout::pp_first_layers, pp_last_layers); "" otherwise. n_layers must pass layout_problem.
std::string pp_split_name(const Layout& layout, int64_t n_layers);
// The modules as --recompute-modules takes them ("layernorm,moe_act"; "" for none).
std::string recompute_modules_name(const RecomputeModules& m);

// Why the layout cannot run this model on this cluster (a message naming the key or option), or
// empty when it can: the processes split into whole pipeline stages, tensor shards and EP groups,
// the layers, heads and experts divide, the pipeline schedule can run the step's micro-batches
// (train.grad_accum), selective recomputation adds to none or moe (moe_act to none only), and
// the cluster has the devices. Every part of the planner takes a layout only after this check.
std::string layout_problem(const RunConfig& cfg, const ClusterSpec& cluster, const Layout& layout);

}  // namespace moetrain::plan
