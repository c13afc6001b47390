// Everything a training run is told: the model, the data, the optimizer, the loop. Loaded from
// a TOML file plus `--set key=value` overrides, validated once; an unknown key or a bad value is
// an error naming the key and what is allowed.
#pragma once
#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/check.h"
#include "core/dtype.h"
#include "model/config.h"
#include "moe/placement.h"
#include "moe/recompute.h"
#include "optim/expert_reweight.h"
#include "optim/loss_scale.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "train/config_schema.h"
#include "train/precision.h"

namespace moetrain {

struct DataConfig {
  std::string dir = "data/fortunes";  // holds train.bin and val.bin (written by `moetrain prepare`)
};

struct OptimSettings {
  std::string name = "adamw";  // adamw | sgd | adagrad | rmsprop
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = 50;
  std::string schedule = "cosine";  // cosine | linear | constant
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;
  double momentum = 0.9;   // sgd, rmsprop
  double grad_clip = 1.0;  // 0 = off

  // Throws naming the key ("optim.lr = -1: must be positive").
  void validate() const;
  // The optimizer these settings describe (the kind's defaults, overridden by the keys it uses).
  OptimizerConfig optimizer_config() const;
  // Warmup then the schedule over `total_steps`; warmup starts at lr / warmup_steps.
  ScheduleConfig schedule_config(int64_t total_steps) const;
};

// The [optim] keys bound to `o`, appended to `fields` (shared by every run configuration).
void add_optim_fields(std::vector<Field>& fields, OptimSettings& o);

// The [train] keys every trainer's loop has, bound to the members of `t` with those names
// (steps, batch_size, seed, eval_every, checkpoint_every, threads, run_dir, progress), appended to
// `fields`; and their checks.
template <class Train>
void add_loop_fields(std::vector<Field>& fields, Train& t);
template <class Train>
void validate_loop(const Train& t);

struct DistSettings;
// data.dir, the [optim] keys, the loop's [train] keys and the [dist] keys: what every run
// configuration has besides its model and its own [train] keys.
template <class Train>
void add_run_fields(std::vector<Field>& fields, std::string& data_dir, OptimSettings& optim,
                    Train& train, DistSettings& dist);

struct TrainConfig {
  int64_t steps = 1000;
  int64_t batch_size = 16;  // sequences per micro-batch per process
  int64_t seq_len = 128;
  int64_t grad_accum = 1;  // micro-batches per optimizer step
  uint64_t seed = 1234;
  int64_t eval_every = 200;  // 0 = only at the end
  int64_t eval_batches = 20;
  int64_t checkpoint_every = 0;  // 0 = only at the end
  int64_t keep_checkpoints = 2;
  int64_t threads = 0;  // 0 = cores / local processes
  std::string run_dir = "runs/default";
  std::string progress = "auto";  // auto | bar | lines | off
  bool tensorboard = true;        // metrics also as TensorBoard events in run_dir/tb
  // Each step's phase profile (core/profile.h) on every process, in metrics.jsonl as
  // profile_<phase>_s (one entry per rank; profile_other_s: the step's time in no phase — the
  // gradient reduction's waits, the small collectives). Costs a clock read per phase and one
  // gather per step; off by default.
  bool profile = false;
  // Mixed precision (Transformer::set_precision): auto | f32 | bf16 | fp16 | tf32. tf32 (with
  // device = cuda): f32 everywhere but the GEMMs, whose operands the tensor cores round to TF32
  // (10-bit mantissa), accumulating in f32. fp16 adds dynamic
  // loss scaling with the loss_scale_* settings (optim/loss_scale.h); they are ignored otherwise.
  // auto: bf16 where oneDNN has a native bf16 matmul (on a GPU: bf16), else f32
  // (train/precision.h), resolved when the configuration loads; the run records the resolved
  // value, and a resumed run keeps the one its checkpoint recorded.
  Precision precision = Precision::F32;
  // The configuration said auto (resolve_precision replaced it): a resume adopts the recorded one.
  bool precision_was_auto = false;
  // cpu | cuda. cuda runs each micro-batch's forward and backward and the one update step on the
  // GPU (src/cuda); checkpoints, metrics and resumption are the CPU run's. One process; precision
  // f32, tf32 or bf16 (auto: bf16); no replicas (RunConfig::validate says what else).
  std::string device = "cpu";
  // Activation recomputation (moe/recompute.h, Transformer::set_recompute): none | moe | full.
  // The same gradients bit for bit, less activation memory, more compute. CPU only.
  Recompute recompute = Recompute::None;
  double loss_scale_init = 65536.0;
  int64_t loss_scale_growth_interval = 2000;
  double loss_scale_growth_factor = 2.0;
  double loss_scale_backoff_factor = 0.5;

  // The model's GEMM operand type on the CPU (gemm_dtype of the resolved precision).
  DType precision_dtype() const { return gemm_dtype(precision); }
  // auto → what this machine computes natively on `device`, logged; other values stay. Done by
  // load_run_config; the trainer calls it again for a configuration built in code.
  void resolve_precision();
  LossScaleConfig loss_scale() const;
};

// How a run under mpirun spreads over its processes (ignored by a single process). World =
// DP × EP: the LM reads train.batch_size sequences per process (a global batch of processes ×
// batch_size × grad_accum); the classifier splits its train.batch_size rows over the processes.
// Not part of the config hash: a checkpoint resumes on any layout.
struct DistSettings {
  int64_t ep = 1;    // expert-parallel group size; divides the processes and model.n_experts
  int64_t zero = 0;  // 1: ZeRO-1, each data-parallel rank keeps optimizer state for its shard only
  double bucket_first_mb = 1.0;  // first gradient bucket of each kind, MiB
  double bucket_mb = 25.0;       // later buckets, MiB
  // The expert all-to-all in two stages, within nodes then between them (parallel/alltoall.h).
  bool hierarchical = false;
  int64_t ranks_per_node = 0;  // with hierarchical: > 0 sets the node size (emulation), 0 detects
  // The adaptive route (parallel/adaptive_route.h): each step's cross-node rows go direct or
  // through the 2-D stages, whichever the measured exchange times say is cheaper; `hierarchical`
  // then names the path it starts on. Needs expert parallelism and the node size
  // (ranks_per_node, or detected).
  bool adaptive_route = false;
  int64_t route_probe_every = 10;  // adaptive: every n-th step measures the other path
  // > 1: each MoE layer cuts its tokens into this many chunks whose all-to-alls run on a
  // communication thread while the experts compute other chunks.
  int64_t a2a_chunks = 1;
  // Reduce gradient buckets on a communication thread while backward produces the next ones.
  bool overlap = true;
  // The collective watchdog (parallel/watchdog.h), seconds a collective may wait: a warning after
  // collective_warn, after collective_timeout the job is aborted for `moetrain launch` to
  // restart (0 = off).
  double collective_warn = 60;
  double collective_timeout = 300;
  // Ranks compare a fingerprint of every collective before it runs (slower; for debugging).
  bool debug_collectives = false;
  // What the data-parallel gradient reduction puts on the wire (f32 | bf16 | int8): bf16 halves
  // the bytes, int8 (block-quantised with error feedback, core/block_quant.h) takes about a
  // quarter; the sums are still taken in f32, in rank order.
  std::string grad_reduce_dtype = "f32";
  // Element type of the expert all-to-all payloads (token rows and their gradients): f32 | bf16.
  std::string a2a_dtype = "f32";
  // What data-parallel replicas synchronise (parallel/param_averaging.h): "grads" reduces the
  // gradients every step; "params" (local SGD) lets every rank step on its own gradients and
  // averages the parameters every sync_every steps (and the optimizer moments with sync_moments).
  std::string sync = "grads";
  int64_t sync_every = 1;
  bool sync_moments = false;
  bool local_steps() const { return sync == "params"; }
  // Optimizer state offload (optim/offload_store.h): "none" keeps it in memory; "host_file" keeps
  // every optimizer state buffer of the process in a file under offload_dir (default
  // <run_dir>/offload; one file per process, removed when the run ends), streamed through a few
  // MiB of memory per step. The f32 parameters stay in memory: the forward reads them.
  std::string offload = "none";
  std::string offload_dir;
  bool offloaded() const { return offload == "host_file"; }
  // The directory the state files go to: offload_dir, or <run_dir>/offload.
  std::string offload_path(const std::string& run_dir) const;
  // With host_file: creates the directory and checks that a file can be written there (leaving
  // nothing behind), and that the run is on the CPU. Throws naming the key and value.
  void validate_offload(const std::string& run_dir, const std::string& device) const;

  // Pipeline parallelism (train/pipeline_step.h): the model's blocks cut into pp stages of
  // contiguous blocks, one per process, running the micro-batches (train.grad_accum) in the
  // order of pp_schedule: gpipe | 1f1b | interleaved | zero_bubble (each backward split into its
  // input-gradient and weight-gradient passes). With interleaved, or zero_bubble on its order,
  // vp chunks a stage: the blocks cut into pp·vp chunks, chunk c on stage c mod pp.
  int64_t pp = 1;
  std::string pp_schedule = "1f1b";
  int64_t vp = 1;
  // Tensor parallelism (model/transformer.h, set_tensor_parallel): each model copy run by tp
  // neighbouring processes on one batch, attention heads, dense FFN hidden units and the LM
  // head's vocabulary split over them, the MoE layers' tokens split; world = DP × tp.
  int64_t tp = 1;
  // With tp > 1: Megatron's sequence parallelism (Transformer::set_tensor_parallel): the
  // residual stream, norms and MoE layers on each rank's share of the tokens.
  bool sequence_parallel = false;
  // Expert tensor parallelism (docs/tensor-parallel.md "Expert tensor parallelism"): each
  // expert's hidden size (model.expert_hidden) split over etp neighbouring ranks; the EP groups
  // are the ranks of one ETP position; world = EDP × ep × etp (1 = off).
  int64_t etp = 1;

  // Throws naming the key ("dist.ep = 0: must be ≥ 1"); what depends on the world size is checked
  // where the process groups are made.
  void validate() const;
};

// The [dist] keys bound to `d`, appended to `fields` (shared by every run configuration).
void add_dist_fields(std::vector<Field>& fields, DistSettings& d);
// The MoE [model] keys bound to `m` (shared by every model's configuration).
void add_moe_fields(std::vector<Field>& fields, MoeModelConfig& m);
// The [balance] keys (the dynamic capacity controller) bound to `m`.
void add_balance_fields(std::vector<Field>& fields, MoeModelConfig& m);

// [grad]: what happens to gradients between backward and the update.
struct GradSettings {
  // Sparse expert gradients (optim/sparse_experts.h): an expert no token reached in a step is not
  // reduced and not updated (lazy Adam). Off: every expert is reduced and stepped (dense).
  bool sparse_experts = false;
  // With sparse_experts: update an expert only if it received tokens in at least ceil(p·A) of the
  // step's A micro-batches (0 = in one). Others are left as they were for the step.
  double min_accum_fraction = 0.0;
  // Per-expert factors on the reduced gradients before the clip (optim/expert_reweight.h):
  // none | importance | utilisation | grad_norm.
  std::string expert_reweight = "none";
  double reweight_decay = 0.9;  // importance: moving-average decay, in [0, 1)
  double util_low = 0.5;        // utilisation: below util_low × mean load → ×2
  double util_high = 2.0;       // utilisation: above util_high × mean load → ×0.5
  // Value-level sparse expert gradients (parallel/sparse_grad.h): each expert gradient bucket
  // sends only this fraction of its values, the largest in magnitude, with their positions; the
  // rest is carried to the next step (error feedback). 0 = off (dense); else in (0, 1].
  double sparse_ratio = 0.0;

  // Throws naming the key ("grad.util_low = -1: must be ...").
  void validate() const;
  // What sparse_ratio needs of the reduction: refused with int8, local steps and fp16 (`fp16`:
  // train.precision = fp16), naming both keys.
  void validate_reduction(const DistSettings& dist, bool fp16) const;
  ExpertReweightConfig expert_reweight_config() const;
};

// The [grad] keys bound to `g`, appended to `fields`.
void add_grad_fields(std::vector<Field>& fields, GradSettings& g);
// Drops from a config's JSON (for its hash) the [grad] keys that do not change what `g` computes,
// and [grad] itself when nothing is left: runs that do not use them hash as before [grad].
void erase_inert_grad_keys(nlohmann::json& j, const GradSettings& g);

// A config's JSON as written before model.route_groups took 1 for "off" (it took 0): read as
// today's (`read_moe_keys_as_now`), and hashed as then (`hash_moe_keys_as_before`), so that
// older checkpoints load and resume; likewise model.overflow = drop and model.balance_loss =
// switch, what every run computed before those keys existed, hash as if absent.
void read_moe_keys_as_now(nlohmann::json& j);
void hash_moe_keys_as_before(nlohmann::json& j);

struct RunConfig {
  ModelConfig model;
  DataConfig data;
  OptimSettings optim;
  TrainConfig train;
  DistSettings dist;
  PlacementConfig placement;  // [placement]: hot-expert replication
  GradSettings grad;          // [grad]

  void validate() const;
  nlohmann::json to_json() const;
  // Hash of the settings that must match between a checkpoint and the run resuming it
  // (the model and the data/optimizer semantics; not the step count or the run directory).
  std::string config_hash() const;
};

// dist.pp > 1: the stages fit the model and the micro-batches, and nothing that the pipeline
// executor does not run is asked for (each refused naming its key). What depends on the number of
// processes is checked where the process groups are made.
void validate_pipeline(const RunConfig& c);
// dist.tp > 1 against the model and the other keys: what the split needs and what does not run
// with it yet, each refused by name.
void validate_tensor_parallel(const RunConfig& c);
// dist.etp > 1 against the model and the other keys: what the split needs and what does not run
// with it yet, each refused by name.
void validate_expert_tensor_parallel(const RunConfig& c);

// Loads `path` (may be empty: defaults only), then applies `overrides` ("model.dim=256").
RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides = {});
// A copy of `base` with `overrides` applied ("dist.hierarchical=true", as --set takes them);
// validated.
RunConfig with_overrides(const RunConfig& base, const std::vector<std::string>& overrides);
// The inverse of RunConfig::to_json (as stored in a checkpoint's config.json); validated.
RunConfig run_config_from_json(const nlohmann::json& j, const std::string& where);
// Every key this loader knows, "section.key", for help texts.
std::vector<std::string> run_config_keys();
// `moetrain config list [SECTION]`: every key (of `section`; all when empty) with its type, its
// default, the allowed values and a line of help. An Error names an unknown section.
std::string run_config_help(const std::string& section);

// --- implementation ------------------------------------------------------------------------------

template <class Train>
void add_loop_fields(std::vector<Field>& fields, Train& t) {
  const Field loop[] = {
      {"train.steps", &t.steps, "Optimizer steps to train"},
      {"train.batch_size", &t.batch_size,
       "Examples per micro-batch: sequences per process (train), images over all processes "
       "(classify)"},
      {"train.seed", &t.seed,
       "Seed of every random stream (initial weights, data order, router noise)"},
      {"train.eval_every", &t.eval_every, "Evaluate every this many steps (0 = only at the end)"},
      {"train.checkpoint_every", &t.checkpoint_every,
       "Write a checkpoint every this many steps (0 = only at the end)"},
      {"train.threads", &t.threads,
       "OpenMP threads per process (0 = the cores shared among this machine's processes)"},
      {"train.run_dir", &t.run_dir,
       "Directory of the run: checkpoints, metrics.jsonl, tb/, the report"},
      {"train.progress", &t.progress,
       "Progress display (auto: a bar on a terminal, lines otherwise)", "auto, bar, lines, off"},
      {"train.tensorboard", &t.tensorboard,
       "Also write the metrics as TensorBoard events in run_dir/tb"},
      {"train.profile", &t.profile, "Time each step's phases on every process, in metrics.jsonl"},
  };
  fields.insert(fields.end(), std::begin(loop), std::end(loop));
}

template <class Train>
void add_run_fields(std::vector<Field>& fields, std::string& data_dir, OptimSettings& optim,
                    Train& train, DistSettings& dist) {
  fields.push_back({"data.dir", &data_dir,
                    "Directory of the training data (train.bin and val.bin from moetrain prepare; "
                    "the classifier's IDX files)"});
  add_optim_fields(fields, optim);
  add_loop_fields(fields, train);
  add_dist_fields(fields, dist);
}

template <class Train>
void validate_loop(const Train& t) {
  MOETRAIN_CHECK(t.steps >= 0, "train.steps = {}: must be ≥ 0", t.steps);
  MOETRAIN_CHECK(t.batch_size > 0, "train.batch_size = {}: must be positive", t.batch_size);
  MOETRAIN_CHECK(t.eval_every >= 0, "train.eval_every = {}: must be ≥ 0 (0 = only at the end)",
                 t.eval_every);
  MOETRAIN_CHECK(t.checkpoint_every >= 0,
                 "train.checkpoint_every = {}: must be ≥ 0 (0 = only at the end)",
                 t.checkpoint_every);
  MOETRAIN_CHECK(t.threads >= 0, "train.threads = {}: must be ≥ 0 (0 = all cores)", t.threads);
  MOETRAIN_CHECK(!t.run_dir.empty(), "train.run_dir must not be empty");
  MOETRAIN_CHECK(
      t.progress == "auto" || t.progress == "bar" || t.progress == "lines" || t.progress == "off",
      "train.progress = '{}': allowed are auto, bar, lines, off", t.progress);
}

}  // namespace moetrain
