// The planner's cost model: step time, memory and scaling of a training run predicted from the
// same RunConfig the trainer reads, on a ClusterSpec, under a load model. Pure arithmetic: it
// runs no training and opens no files (load models from metrics are read in load_model.h).
//
// Layout (plan/layout.h): world = PP × TP × DP processes, the experts' EP folded over a stage's
// TP × DP ranks; with tp = pp = 1, as the trainer runs, every process holds every dense weight
// and E / EP experts per MoE layer.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "plan/cluster.h"
#include "plan/comm_model.h"
#include "plan/flops.h"
#include "plan/layout.h"
#include "train/memory_estimate.h"
#include "train/run_config.h"

namespace moetrain::plan {

// How tokens spread over experts: fractions per MoE layer (each sums to 1). One row is used for
// every layer when fewer rows than layers are given.
struct LoadModel {
  std::string kind = "uniform";                // uniform | zipf | measured
  std::vector<std::vector<double>> fractions;  // (layers or 1, E)
  // Measured: each step's own fractions (steps, layers, E); a step's experts wait for that
  // step's slowest rank. Empty: `fractions` for every step.
  std::vector<std::vector<std::vector<double>>> steps;
};
// The load models (plan/load_model.cpp, with the measured ones):
LoadModel uniform_load(int64_t E);
// p_e ∝ 1 / (e + 1)^s: the hottest experts sit together on the first EP rank (worst placement).
LoadModel zipf_load(int64_t E, double s);

// Seconds of one optimizer step (all micro-batches), by part; forward + backward together.
struct StepParts {
  double attention = 0;      // QKV/O projections, scores and values, RoPE
  double router = 0;         // gate GEMM, softmax / top-k
  double experts = 0;        // the slowest rank's expert GEMMs and SwiGLU (sets the step)
  double experts_mean = 0;   // the same at the mean load (what perfect balance would take)
  double shared_expert = 0;  // shared expert and dense FFN layers
  double norms = 0;          // RMSNorms, residual adds, dispatch/combine copies, embedding
  double lm_head = 0;        // LM head GEMM and cross-entropy
  double optimizer = 0;      // clip + update over this process's parameters and state
  double a2a = 0;            // expert all-to-alls, total
  double a2a_exposed = 0;    // what chunking did not hide
  double grad_sync = 0;      // gradient all-reduce (or reduce-scatter + all-gather), total
  double grad_sync_exposed = 0;
  // TP all-reduces of activations and ETP's all-gathers / reduce-scatters of expert rows (not
  // overlapped)
  double tensor_parallel = 0;
  double pipeline_bubble = 0;  // a stage's idle time in the pipeline schedule, sends included
  double sync = 0;  // small latency-bound collectives (balance statistics, norm, metrics)
  // The compute slowed beside the hidden exchanges and reductions (DeviceModel::
  // comm_compute_share of the time they run hidden).
  double comm_contention = 0;
  double compute() const {
    return attention + router + experts + shared_expert + norms + lm_head + optimizer;
  }
};

struct Memory {  // bytes per device
  double params = 0, grads = 0, optimizer = 0, low_precision = 0, activations = 0;
  double buffers = 0;                 // communication buffers (train/memory_estimate.h)
  double optimizer_without_zero = 0;  // what the optimizer state would take without ZeRO
  double total() const {
    return params + grads + optimizer + low_precision + activations + buffers;
  }
};

struct Prediction {
  Layout layout;
  // The blocks a pipeline stage holds where they are uneven, first/middle/last (pp_split_name).
  std::string pp_split;
  StepParts parts;
  Memory memory;
  double step_time_s = 0;
  double flops_per_step = 0;  // model FLOPs (forward + backward) of the whole step, all processes
  double mfu = 0;             // flops_per_step / (step_time_s · devices · peak of the precision)
  double tokens_per_s = 0;
  double flops_per_device_s = 0;  // model FLOP/s per device (what published runs quote)
  // Busy fraction: compute at the balanced expert load over the step time.
  double utilisation = 0;
  // Bandwidth-only time of the same traffic at uniform load (no latency) over the time the
  // all-to-alls and reductions take: 1 = the links run at their full rate.
  double comm_efficiency = 1;
  double imbalance = 1;  // slowest rank's expert tokens over the mean
  // The design's expert utilisation: the expected share of experts a micro-batch activates
  // (plan/grad_model.h expert_activity).
  double experts_active = 1;
  // Oversubscribed processes on this machine: the share of its speed alone a process's compute
  // got (ClusterSpec::compute_share); 1 elsewhere.
  double compute_share = 1;
  bool fits = true;
  // Why `moetrain train` does not run the layout with the config (plan/layout.h planner_only);
  // empty where it does.
  std::string planner_only;
  bool trainer_runs() const { return planner_only.empty(); }
  std::string a2a_kind;  // flat | hierarchical | deduplicated | none
  // dist.hierarchical as asked: flat where the EP group fits in one node, or without EP.
  bool hierarchical_asked = false;
  CommBreakdown comm;  // the all-to-all and reduction times above, written out
  // pp > 1: the step's pipeline schedule as the bubble was timed (each stage's passes, seconds
  // from the step's first pass).
  PipeTimeline pipe_timeline;
};

// Throws (naming the key) when the layout does not divide or the model does not fit.
Prediction predict(const RunConfig& cfg, const ClusterSpec& cluster, const Layout& layout,
                   const LoadModel& load);

// Throws "does not fit: needs X GiB per device" when the prediction exceeds device.memory_bytes.
void check_fits(const Prediction& p, const ClusterSpec& cluster);

nlohmann::json to_json(const Prediction& p);
// A human-readable table of one or several predictions (a sweep).
std::string format_table(const std::vector<Prediction>& ps);
// One prediction's communication written out: each collective's phases and their terms, the
// flat and hierarchical all-to-all side by side, and how many of each a step runs.
std::string format_comm(const Prediction& p);

// --- formulas, exposed for the unit tests
// ---------------------------------------------------------

// The backward a bucketed gradient reduction can hide behind: two thirds of the slowest rank's
// compute (forward + backward = 3 forwards), its experts counted once, without the optimizer
// (it runs after the reduction).
double backward_window(const StepParts& s);
// What stays exposed of a reduction of `reduction` seconds in `buckets` buckets that starts as
// backward does and overlaps a `window` of it: what outlasts the window, and at least the last
// bucket (it is ready only when backward ends).
double overlap_exposed(double reduction, double buckets, double window);
// What the exchange overlapped with another micro-batch's compute hides (Layout::a2a_overlap):
// of the exposed all-to-all s.a2a_exposed, at most (A − 1)/A of the layers' compute of the step
// (each micro-batch's exchanges beside another's compute; the first has none), less what the
// chunks already hid behind the experts; 0 without the layout's overlap, with one micro-batch,
// or where communication takes its core from compute.
double other_microbatch_hidden(const Layout& layout, const StepParts& s, int64_t A,
                               bool comm_shares_cores);
// Floats of every dense tensor and of all experts of all layers: train/memory_estimate.h's.
// `accelerator` below: a GPU (built-in or [device] table, not a calibrated CPU).
using moetrain::count_params;
using moetrain::ParamCounts;

// Bytes of the weights, gradients and optimizer state (train/memory_estimate.h's ParamState:
// this trainer's on a CPU profile or in f32, GPU mixed precision on an accelerator in bf16/fp16,
// ZeRO as the layout or dist.zero says), and of the activations of one micro-batch (all of them,
// or with recomputation each layer's input and one layer's). The layout is one layout_problem
// accepts.
Memory memory_per_device(const RunConfig& cfg, const Layout& layout, bool accelerator = false);
// The rank layout (train/memory_estimate.h) memory_per_device estimates: the trainer's for the
// config on layout.procs processes, with the layout's ep, tp, pp, ZeRO stage and recomputation,
// and on an accelerator GPU trainers' state and activations.
RankLayout rank_layout(const RunConfig& cfg, const Layout& layout, bool accelerator = false);
// Bytes of an activation element: the run's precision on an accelerator in bf16/fp16 (GPU
// trainers keep them so), else f32 (this trainer's f32 masters). Element-wise work streams them.
double activation_bytes(const RunConfig& cfg, bool accelerator);
// The ZeRO stage of a run: the layout's (--zero), else dist.zero.
int64_t zero_stage(const RunConfig& cfg, const Layout& layout);
// Activation recomputation: the layout's (--recompute), else train.recompute.
Recompute recompute_mode(const RunConfig& cfg, const Layout& layout);

}  // namespace moetrain::plan
