// An up-front estimate of a run's memory, checked against what the machine has before anything
// large is allocated: a config that cannot fit is refused at once with both figures, instead of
// allocating for a while and dying of std::bad_alloc.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "train/host_memory.h"
#include "model/classifier.h"
#include "model/activation_bytes.h"
#include "model/config.h"
#include "moe/recompute.h"
#include "train/run_config.h"

namespace moetrain {

// Bytes per process, by kind.
struct MemoryEstimate {
  double parameters = 0;     // the weights as stored (fp32 here)
  double gradients = 0;      // fp32, one per parameter
  double optimizer = 0;      // fp32 optimizer state (AdamW: two moments) and master weights
  double low_precision = 0;  // bf16/fp16 weight copies
  double activations = 0;    // saved for backward, and the backward buffers the layers keep
  double buffers = 0;        // communication: gradient buckets, an offload window
  double baseline = 0;       // the process before any of these: the binary, its libraries, MPI
  // What the parameters take: weights, gradients, optimizer state and copies.
  double state() const { return parameters + gradients + optimizer + low_precision; }
  double total() const { return state() + activations + buffers + baseline; }
  std::string breakdown() const;
  // One line per kind, then the total, each in GiB or MiB: the dry run's table.
  std::string table() const;
};

// How a process keeps each parameter's state: bytes per parameter of each kind, and which of
// them ZeRO shards over the ranks that hold copies of the parameter (stage 1: the optimizer
// state, f32 master weights included; 2: also the gradients; 3: also the weights and their
// copies). The one formula of state memory: the trainer's start-up estimate and the planner
// (plan/memory_model.cpp) both use it.
struct ParamState {
  double weight = 4;  // the weights as stored: f32 here, bf16/fp16 where f32 masters are apart
  double grad = 4;    // gradients, f32 (accumulated over micro-batches)
  double copy = 0;    // a low-precision copy of f32 weights for the GEMMs (this trainer's bf16)
  double master = 0;  // f32 master weights apart from low-precision weights
  double slots = 2;   // f32 optimizer state floats per parameter: AdamW 2, others 1
  int zero = 0;       // ZeRO stage, 0–3
};
// This trainer: f32 weights and gradients, the bf16/fp16 copy of a low-precision run
// (precision_bytes 2; 0 for f32), the optimizer's f32 state.
ParamState trainer_state(const std::string& optimizer, int precision_bytes, int zero);
// GPU mixed precision as Megatron-Core and DeepSpeed keep it: bf16/fp16 weights, f32 gradients
// (Megatron's main_grad), f32 master weights with the optimizer state (its distributed optimizer
// shards both: ZeRO-1).
ParamState mixed_precision_state(const std::string& optimizer, int zero);
// The bytes `params` parameters kept as `s` take on one process, the kinds ZeRO shards divided
// over `ranks`: parameters (weights), gradients, optimizer (master weights and slots),
// low_precision (copies). No activations.
MemoryEstimate state_memory(const ParamState& s, double params, double ranks);

// Floats of the dense tensors (embedding, head, norms, attention, dense FFNs, routers, shared
// experts) and of all experts of all MoE layers, from the shapes ParamLayout (model/params.cpp)
// lays out, without building its table (tests/plan/scale_test.cpp checks the two agree).
struct ParamCounts {
  double dense = 0, expert = 0;
};
// The same per unit, the flat buffer's ranges ZeRO-3 gathers whole, in forward order: 0 the
// embedding, 1 + l block l (its norms, attention, dense FFN or router, shared expert and
// experts), L + 1 the final norm with the LM head (L + 2 units).
std::vector<ParamCounts> unit_params(const ModelConfig& m);
// Their sum.
ParamCounts count_params(const ModelConfig& m);

// Where the optimizer state lives: resident, or in a host file streamed through a window.
enum class Offload { None, HostFile };

// One process's share of a run: what the estimate of its memory depends on.
struct RankLayout {
  int64_t world = 1;        // processes (tp × pp × dp, dp folding ep)
  int64_t ep = 1;           // expert-parallel group size: E / ep experts owned per rank
  int64_t etp = 1;          // expert tensor parallelism: 1 / etp of each owned expert (planner)
  int64_t spare_slots = 0;  // placement.spare_slots: replica slots per rank (with ep > 1)
  int64_t tp = 1, pp = 1;   // tensor and pipeline parallelism
  // Tensor parallelism as this engine runs it (dist.tp, Transformer::set_tensor_parallel): every
  // rank keeps the whole parameters, gradients and (ZeRO sharding it over every rank) optimizer
  // state; of the activations 1/tp of q, k, v, the attention's output, the dense FFNs' hidden
  // units and the logits, the residual stream and the norms whole, the MoE layers on 1/tp of the
  // tokens (tp_activation_parts). false: Megatron's with sequence parallelism, 1/tp of the dense
  // weights and their state and of every activation (the planner's for GPU trainers).
  bool whole_params_under_tp = false;
  // The engine's sequence parallelism (dist.sequence_parallel, with whole_params_under_tp): the
  // residual stream, its norms' rstd and the MoE layers' norm outputs hold the rank's 1/tp of the
  // tokens (tp_activation_parts).
  bool sequence_parallel = false;
  // Micro-batches whose activations of the stage's L / pp layers the first stage holds at
  // once (parallel/pipeline_schedule.h, PipeTimeline::peak_in_flight); 0: pp, as 1F1B.
  double pipe_in_flight = 0;
  // zero_bubble: backward defers the dense weight gradients to the weight pass, keeping their
  // output gradients (deferred_grad_parts) in between.
  bool pipe_split_backward = false;
  ParamState state;         // bytes per parameter and the ZeRO stage
  Recompute recompute = Recompute::None;
  Offload offload = Offload::None;
  // This trainer keeps the weights, gradients and copy of every expert in its flat buffer on
  // every rank (it steps only its own), ZeRO-2 only the gradients of the units backward is
  // writing or reducing, ZeRO-3 its shard and the units it gathers (rank_memory); false: only the
  // rank's experts, sharded by state_memory (GPU trainers).
  bool whole_buffer = true;
  // This trainer's layers keep the buffers of their backward (the gradients of what they saved,
  // both sides of the expert exchange) between steps; false: only what backward needs.
  bool kept_backward_buffers = true;
  double activation_bytes = 4;  // bytes of an activation element
  // Gradient buckets (dist.bucket_first_mb, dist.bucket_mb) and their wire copies, with world > 1.
  double bucket_first_bytes = 1 << 20, bucket_bytes = 25 << 20;
  double baseline = 0;  // the process's resident bytes before the run's allocations
  int64_t stage() const { return world / (tp * pp); }  // ranks holding the same dense shard
  // Ranks a dense tensor's ZeRO state is sharded over, and the parts its weights are cut into.
  int64_t dense_ranks() const { return whole_params_under_tp ? world / pp : stage(); }
  int64_t dense_split() const { return whole_params_under_tp ? pp : tp * pp; }
  int64_t dp() const { return world / pp / (ep * etp); }  // replicas of each expert shard
};

// The bytes one rank of an LM run holds: the one formula of the trainer's start-up check, of
// `moetrain train --dry-run` and of the planner (plan/memory_model.cpp). With whole_buffer and
// more than one copy of a stage (of the model without stages), by unit (unit_params; a block as
// the rank holds it: its dense tensors and its experts): ZeRO-2 gradients max(2 buckets, largest
// unit + a bucket); ZeRO-3 weights the rank's shard (state_memory) and the largest two
// neighbouring units gathered, gradients those two units; in stages the gradients are the
// stage's, reduced once a step; each at most the whole buffer.
MemoryEstimate rank_memory(const ModelConfig& m, int64_t batch, int64_t seq_len,
                           const RankLayout& l);

// The activations one rank of a tensor-parallel group of tp ranks holds after a training
// forward, as the engine splits them (Transformer::set_tensor_parallel; activation_parts at
// tp = 1): attention heads, dense FFN hidden units and vocabulary columns 1/tp, each MoE layer's
// routing, rows and intermediates for N / tp of the N = B·T tokens (dropless, expert parallelism
// not counted: its received rows are buffers), the rest whole. sequence_parallel: also the
// residual stream (each block's input and the stream leaving the last), the attention's and the
// FFN's outputs, the norms' rstd and an MoE layer's norm output for N / tp tokens; what enters
// the attention, a dense FFN and the head stays gathered whole.
ActivationBytes tp_activation_parts(const ModelConfig& m, int64_t B, int64_t T, Recompute r,
                                    DType lp, int64_t tp, bool sequence_parallel = false);

// The layout `moetrain train` runs a config with on `world` processes: dist.ep, dist.zero,
// dist.pp and its schedule, dist.tp (whole_params_under_tp), placement.spare_slots, the precision's copy, dist.bucket_*; `baseline` the process's resident
// bytes before the run's allocations.
RankLayout trainer_layout(const RunConfig& cfg, int64_t world, double baseline);

// One process of an LM run (rank_memory on RankLayout's defaults); precision_bytes: 0 for f32,
// 2 for bf16/fp16 (their weight copies).
MemoryEstimate estimate_memory(const ModelConfig& m, int64_t batch, int64_t seq_len,
                               int precision_bytes);
MemoryEstimate estimate_memory(const ClassifierConfig& m, int64_t batch);
// A loaded model that only runs forward (forward, eval, sample): its parameters and one batch's
// activations; no gradients, moments or copies.
MemoryEstimate estimate_inference_memory(const ModelConfig& m, int64_t batch, int64_t seq_len);

// Throws when `processes` processes of this estimate (the ones on this machine) exceed the
// available memory, naming both figures per rank and what the estimate counts. `remedy` says what to make
// smaller (default: the model.* and train.* keys that size a run).
void check_memory(const MemoryEstimate& e, int processes, const std::string& what,
                  const std::string& remedy = {});

}  // namespace moetrain
