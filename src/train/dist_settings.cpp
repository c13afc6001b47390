// The [dist] and [grad] sections of a run's configuration (train/run_config.h): their keys for
// the configuration schema and their validation, alone and against each other.
#include <fmt/format.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "parallel/grad_wire.h"
#include "parallel/pipeline_schedule.h"
#include "train/run_config.h"

namespace moetrain {

namespace fs = std::filesystem;

void add_dist_fields(std::vector<Field>& fields, DistSettings& d) {
  const Field dist[] = {
      {"dist.ep", &d.ep, "Expert-parallel group size: processes the experts are sharded over"},
      {"dist.zero", &d.zero,
       "ZeRO stage under MPI: 0 off; 1 each data-parallel process keeps the optimizer state of "
       "its shard; 2 also keeps only its shard of the reduced gradients (each bucket's flat "
       "gradients are released once reduce-scattered; with grad_accum every micro-batch is "
       "reduced, A times the reduction traffic); 3 also keeps only its shard of the parameters "
       "(each unit — the embedding, a block, the head — all-gathered just before it computes, "
       "the next one prefetched, released after)",
       "0, 1, 2, 3"},
      {"dist.bucket_first_mb", &d.bucket_first_mb,
       "Size of the first gradient bucket of each kind, MiB"},
      {"dist.bucket_mb", &d.bucket_mb, "Size of the later gradient buckets, MiB (at most 1024)"},
      {"dist.hierarchical", &d.hierarchical,
       "Expert all-to-all in two stages, within nodes then between them"},
      {"dist.ranks_per_node", &d.ranks_per_node,
       "With hierarchical or adaptive_route: processes per node (0 = detect)"},
      {"dist.adaptive_route", &d.adaptive_route,
       "Expert all-to-all: each step's cross-node rows go direct or through the 2-D route, "
       "whichever measured cheaper (hierarchical names the starting path)"},
      {"dist.route_probe_every", &d.route_probe_every,
       "With adaptive_route: every n-th step takes the other path to measure it, n ≥ 2"},
      {"dist.a2a_chunks", &d.a2a_chunks,
       "Chunks each MoE layer's all-to-all is cut into to overlap it with expert compute, in [1, "
       "64]"},
      {"dist.overlap", &d.overlap,
       "Reduce gradient buckets on a communication thread while backward runs"},
      {"dist.collective_warn", &d.collective_warn,
       "Warn when a collective waits this many seconds (0 = never)"},
      {"dist.collective_timeout", &d.collective_timeout,
       "Abort the job when a collective waits this many seconds (0 = never)"},
      {"dist.debug_collectives", &d.debug_collectives,
       "Compare a fingerprint of every collective across processes first (slower)"},
      {"dist.grad_reduce_dtype", &d.grad_reduce_dtype,
       "What the gradient reduction sends; the sums stay f32", "f32, bf16, int8"},
      {"dist.a2a_dtype", &d.a2a_dtype, "Element type of the expert all-to-all payloads",
       "f32, bf16"},
      {"dist.sync", &d.sync,
       "What replicas synchronise: gradients every step, or parameters every sync_every steps "
       "(local SGD)",
       "grads, params"},
      {"dist.sync_every", &d.sync_every, "With sync = params: steps between parameter averagings"},
      {"dist.sync_moments", &d.sync_moments,
       "With sync = params: also average the optimizer moments"},
      {"dist.offload", &d.offload,
       "Where the optimizer state lives: in memory, or in a file on local disk streamed through "
       "a few MiB per step (the f32 parameters stay in memory)",
       "none, host_file"},
      {"dist.pp", &d.pp,
       "Pipeline stages: the model's blocks cut into this many stages of contiguous blocks, one "
       "per process (1 = off)"},
      {"dist.pp_schedule", &d.pp_schedule,
       "With pp > 1: the order of the stages' passes over the micro-batches (train.grad_accum)",
       "gpipe, 1f1b, interleaved, zero_bubble"},
      {"dist.vp", &d.vp,
       "With pp_schedule = interleaved or zero_bubble: model chunks a stage (the blocks cut "
       "into pp·vp chunks, "
       "chunk c on stage c mod pp; 1 = one chunk a stage)"},
      {"dist.tp", &d.tp,
       "Tensor parallelism: processes that run one model copy on one batch, its attention "
       "heads, dense FFN hidden units and LM head vocabulary split over them and its MoE layers' "
       "tokens shared out (1 = off)"},
      {"dist.sequence_parallel", &d.sequence_parallel,
       "With tp > 1: the residual stream, the norms and the MoE layers run on each rank's share "
       "of the tokens (all-gather before the attention, dense FFN and head; reduce-scatter after)"},
      {"dist.etp", &d.etp,
       "Expert tensor parallelism: each expert's hidden size split over this many neighbouring "
       "processes, the expert-parallel groups formed over the ranks of one position (world = "
       "expert data parallel × ep × etp; 1 = off)"},
      {"dist.offload_dir", &d.offload_dir,
       "With offload = host_file: directory of the state files, one per process (empty = "
       "<run_dir>/offload)"},
  };
  fields.insert(fields.end(), std::begin(dist), std::end(dist));
}

void add_grad_fields(std::vector<Field>& fields, GradSettings& g) {
  const Field grad[] = {
      {"grad.sparse_experts", &g.sparse_experts,
       "Skip the reduction and update of experts no token reached in a step"},
      {"grad.min_accum_fraction", &g.min_accum_fraction,
       "With sparse_experts: update an expert only if tokens reached it in this share of the "
       "micro-batches"},
      {"grad.expert_reweight", &g.expert_reweight,
       "Per-expert factors on the reduced gradients before the clip",
       "none, importance, utilisation, grad_norm"},
      {"grad.reweight_decay", &g.reweight_decay,
       "importance reweighting: moving-average decay, in [0, 1)"},
      {"grad.util_low", &g.util_low,
       "utilisation reweighting: experts below this multiple of the mean load get ×2"},
      {"grad.util_high", &g.util_high,
       "utilisation reweighting: experts above this multiple of the mean load get ×0.5"},
      {"grad.sparse_ratio", &g.sparse_ratio,
       "Expert gradients: reduce only this fraction of values, the largest, with error feedback "
       "(0 = off, else in (0, 1])"},
  };
  fields.insert(fields.end(), std::begin(grad), std::end(grad));
}

void GradSettings::validate() const {
  MOETRAIN_CHECK(
      std::isfinite(min_accum_fraction) && min_accum_fraction >= 0 && min_accum_fraction <= 1,
      "grad.min_accum_fraction = {}: must be in [0, 1]", min_accum_fraction);
  MOETRAIN_CHECK(min_accum_fraction == 0 || sparse_experts,
                 "grad.min_accum_fraction = {} needs grad.sparse_experts = true",
                 min_accum_fraction);
  parse_expert_reweight(expert_reweight);
  MOETRAIN_CHECK(reweight_decay >= 0 && reweight_decay < 1,
                 "grad.reweight_decay = {}: must be in [0, 1)", reweight_decay);
  MOETRAIN_CHECK(std::isfinite(util_low) && util_low >= 0,
                 "grad.util_low = {}: must be a multiple of the mean load ≥ 0", util_low);
  MOETRAIN_CHECK(std::isfinite(util_high) && util_high >= util_low,
                 "grad.util_high = {}: must be ≥ grad.util_low = {}", util_high, util_low);
  MOETRAIN_CHECK(sparse_ratio == 0 || (sparse_ratio > 0 && sparse_ratio <= 1),
                 "grad.sparse_ratio = {}: must be in (0, 1] (the fraction of expert gradient "
                 "values reduced), or 0 for off",
                 sparse_ratio);
}

void GradSettings::validate_reduction(const DistSettings& dist, bool fp16) const {
  MOETRAIN_CHECK(!(dist.zero >= 2 && sparse_experts),
                 "dist.zero = {} with grad.sparse_experts = true: a skipped expert's gradients "
                 "would have to stay in the flat buffer ZeRO-{} releases; use dist.zero = 1 or "
                 "grad.sparse_experts = false",
                 dist.zero, dist.zero);
  MOETRAIN_CHECK(!(dist.zero >= 2 && sparse_ratio != 0),
                 "dist.zero = {} with grad.sparse_ratio = {}: the sparse expert buckets are summed "
                 "whole on every rank, not reduce-scattered; use dist.zero = 1 or "
                 "grad.sparse_ratio = 0",
                 dist.zero, sparse_ratio);
  if (sparse_ratio == 0) return;
  MOETRAIN_CHECK(dist.grad_reduce_dtype != "int8",
                 "grad.sparse_ratio = {} with dist.grad_reduce_dtype = int8: the sparse lists "
                 "carry f32 or bf16 values; use dist.grad_reduce_dtype = f32 or bf16",
                 sparse_ratio);
  MOETRAIN_CHECK(!dist.local_steps(),
                 "grad.sparse_ratio = {} with dist.sync = params: local steps reduce no "
                 "gradients; use dist.sync = grads or grad.sparse_ratio = 0",
                 sparse_ratio);
  // As int8's: the residual would carry loss-scaled gradients across changes of the scale.
  MOETRAIN_CHECK(!fp16,
                 "grad.sparse_ratio = {} with train.precision = fp16: the error-feedback residual "
                 "cannot follow the loss scale; use train.precision = bf16 or f32",
                 sparse_ratio);
}

void erase_inert_grad_keys(nlohmann::json& j, const GradSettings& g) {
  if (!j.contains("grad")) return;
  if (!g.sparse_experts) {
    j["grad"].erase("sparse_experts");
    j["grad"].erase("min_accum_fraction");
  }
  if (g.sparse_ratio == 0) j["grad"].erase("sparse_ratio");
  if (g.expert_reweight == "none")
    for (const char* k : {"expert_reweight", "reweight_decay", "util_low", "util_high"})
      j["grad"].erase(k);
  if (j["grad"].empty()) j.erase("grad");
}

ExpertReweightConfig GradSettings::expert_reweight_config() const {
  return {parse_expert_reweight(expert_reweight), reweight_decay, util_low, util_high};
}

std::string DistSettings::offload_path(const std::string& run_dir) const {
  return offload_dir.empty() ? (fs::path(run_dir) / "offload").string() : offload_dir;
}

void DistSettings::validate_offload(const std::string& run_dir, const std::string& device) const {
  if (!offloaded()) return;
  MOETRAIN_CHECK(device == "cpu",
                 "dist.offload = host_file with train.device = {}: the state file is streamed by "
                 "the CPU optimizer; the device keeps its state there (use "
                 "dist.offload = none)",
                 device);
  const fs::path dir = offload_path(run_dir);
  const std::string key = offload_dir.empty()
                              ? fmt::format("dist.offload_dir (default {})", dir.string())
                              : fmt::format("dist.offload_dir = '{}'", offload_dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  MOETRAIN_CHECK(!ec && fs::is_directory(dir), "{}: cannot create the directory: {}", key,
                 ec ? ec.message() : "a file of that name is in the way");
  const fs::path probe = dir / fmt::format(".probe-{}", ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  const int err = errno;
  if (fd >= 0) ::close(fd), ::unlink(probe.c_str());
  MOETRAIN_CHECK(fd >= 0, "{}: cannot write a file there: {}", key, std::strerror(err));
}

void DistSettings::validate() const {
  MOETRAIN_CHECK(offload == "none" || offload == "host_file",
                 "dist.offload = '{}': allowed are none, host_file", offload);
  parse_grad_wire(grad_reduce_dtype, "dist.grad_reduce_dtype");
  parse_dtype(a2a_dtype, "dist.a2a_dtype", {DType::F32, DType::BF16});
  MOETRAIN_CHECK(ep >= 1, "dist.ep = {}: must be ≥ 1", ep);
  MOETRAIN_CHECK(sync == "grads" || sync == "params", "dist.sync = '{}': allowed are grads, params",
                 sync);
  MOETRAIN_CHECK(sync_every >= 1, "dist.sync_every = {}: must be ≥ 1", sync_every);
  MOETRAIN_CHECK(zero >= 0 && zero <= 3,
                 "dist.zero = {}: allowed are 0 (off), 1 (ZeRO-1: optimizer state sharded), 2 "
                 "(ZeRO-2: gradients sharded too) and 3 (ZeRO-3: parameters sharded too)",
                 zero);
  MOETRAIN_CHECK(!(local_steps() && zero >= 1),
                 "dist.sync = params with dist.zero = {}: ZeRO shards one optimizer state over "
                 "the replicas, local steps need a whole one on each; use dist.zero = 0",
                 zero);
  // int8's error feedback keeps a residual per gradient element sent: a whole gradient's worth.
  MOETRAIN_CHECK(!(zero >= 2 && grad_reduce_dtype == "int8"),
                 "dist.zero = {} with dist.grad_reduce_dtype = int8: int8's error-feedback "
                 "residual is as large as the whole gradient ZeRO-{} releases; use "
                 "dist.grad_reduce_dtype = f32 or bf16, or dist.zero = 1",
                 zero, zero);
  MOETRAIN_CHECK(
      bucket_first_mb > 0 && bucket_mb > 0 && bucket_mb <= 1024,
      "dist.bucket_first_mb = {}, dist.bucket_mb = {}: must be positive MiB (at most 1024)",
      bucket_first_mb, bucket_mb);
  MOETRAIN_CHECK(ranks_per_node >= 0, "dist.ranks_per_node = {}: must be ≥ 0 (0 = detect)",
                 ranks_per_node);
  MOETRAIN_CHECK(a2a_chunks >= 1 && a2a_chunks <= 64, "dist.a2a_chunks = {}: must be in [1, 64]",
                 a2a_chunks);
  MOETRAIN_CHECK(route_probe_every >= 2, "dist.route_probe_every = {}: must be ≥ 2",
                 route_probe_every);
  MOETRAIN_CHECK(!adaptive_route || ep >= 2,
                 "dist.adaptive_route = true with dist.ep = {}: the route of the expert all-to-all "
                 "needs expert parallelism (dist.ep ≥ 2)",
                 ep);
  MOETRAIN_CHECK(pp >= 1, "dist.pp = {}: must be ≥ 1 (pipeline stages; 1 = off)", pp);
  const PipeSchedule schedule = parse_pipe_schedule(pp_schedule, "dist.pp_schedule");
  MOETRAIN_CHECK(vp >= 1, "dist.vp = {}: must be ≥ 1 (model chunks a pipeline stage)", vp);
  MOETRAIN_CHECK(vp == 1 || schedule == PipeSchedule::Interleaved ||
                     schedule == PipeSchedule::ZeroBubble,
                 "dist.vp = {} with dist.pp_schedule = {}: model chunks a stage are the "
                 "interleaved and zero_bubble schedules'; set dist.pp_schedule = interleaved "
                 "(or zero_bubble) or dist.vp = 1",
                 vp, pp_schedule);
  MOETRAIN_CHECK(vp == 1 || pp > 1,
                 "dist.vp = {} with dist.pp = 1: model chunks are cut over pipeline stages; set "
                 "dist.pp > 1 or dist.vp = 1",
                 vp);
  MOETRAIN_CHECK(tp >= 1, "dist.tp = {}: must be ≥ 1 (tensor-parallel ranks; 1 = off)", tp);
  MOETRAIN_CHECK(!sequence_parallel || tp > 1,
                 "dist.sequence_parallel = true with dist.tp = {}: it splits the tokens over the "
                 "tensor-parallel ranks; set dist.tp ≥ 2",
                 tp);
  MOETRAIN_CHECK(etp >= 1, "dist.etp = {}: must be ≥ 1 (expert tensor-parallel ranks; 1 = off)",
                 etp);
  MOETRAIN_CHECK(std::isfinite(collective_warn) && collective_warn >= 0,
                 "dist.collective_warn = {}: must be seconds ≥ 0 (0 = no warning)",
                 collective_warn);
  MOETRAIN_CHECK(std::isfinite(collective_timeout) && collective_timeout >= 0,
                 "dist.collective_timeout = {}: must be seconds ≥ 0 (0 = never abort)",
                 collective_timeout);
}

void validate_tensor_parallel(const RunConfig& c) {
  const DistSettings& d = c.dist;
  if (d.tp == 1) return;
  const ModelConfig& m = c.model;
  auto divides = [&](int64_t n, const std::string& what) {
    MOETRAIN_CHECK(n % d.tp == 0,
                   "dist.tp = {} does not divide {} = {}: each tensor-parallel rank takes an "
                   "equal share; use a dist.tp that divides it",
                   d.tp, what, n);
  };
  divides(m.n_heads, "model.n_heads");
  divides(m.n_kv_heads, "model.n_kv_heads");
  divides(m.vocab_size, "model.vocab_size");
  for (int64_t l = 0; l < m.n_layers; ++l)
    if (m.is_dense_layer(l)) {
      divides(m.dense_ffn_hidden(), "the dense layers' FFN hidden size");
      break;
    }
  // What tensor parallelism does not run yet: each refused by name, none ignored.
  auto refuse = [&](bool bad, const std::string& what) {
    MOETRAIN_CHECK(!bad, "dist.tp = {} with {}: tensor parallelism does not run it yet; {}",
                   d.tp, what, "leave it at its default or set dist.tp = 1");
  };
  refuse(c.train.device != "cpu", fmt::format("train.device = {}", c.train.device));
  // Sequence parallelism runs in pipeline stages: a stage's input and output are each rank's
  // tokens of the residual stream, sent from rank t of a stage to rank t of the next.
  // Expert parallelism runs inside the stages of tensor-parallel groups: a stage's copies are
  // every tensor-parallel rank of the stage in every pipeline, all holding MoE tokens, and form
  // its expert groups (dist.ep dividing them: train/parallel_setup.cpp, make_run_parallel).
  // Local steps: a copy is a tensor-parallel group, whose experts must be its own.
  refuse(d.local_steps() && d.ep > 1,
         fmt::format("dist.sync = params and dist.ep = {} (experts shared by several copies)",
                     d.ep));
  // ZeRO-2 and 3, offloaded state and fp16 run, inside pipeline stages too: the reduction sums
  // every rank's gradients over the world, or over the stage's copies, which are every
  // tensor-parallel rank of the stage, before a shard is checked or stepped (ZeRO-3: and
  // gathered), and the norm and the fp16 overflow flag are summed over the world.
  refuse(d.hierarchical, "dist.hierarchical = true (an expert all-to-all route)");
  refuse(d.adaptive_route, "dist.adaptive_route = true (an expert all-to-all route)");
  refuse(c.placement.enabled(),
         fmt::format("placement.spare_slots = {}", c.placement.spare_slots));
}

void validate_expert_tensor_parallel(const RunConfig& c) {
  const DistSettings& d = c.dist;
  if (d.etp == 1) return;
  MOETRAIN_CHECK(c.model.expert_hidden % d.etp == 0,
                 "dist.etp = {} does not divide model.expert_hidden = {}: each expert "
                 "tensor-parallel rank computes an equal share of every expert's hidden units; "
                 "use a dist.etp that divides it",
                 d.etp, c.model.expert_hidden);
  // What expert tensor parallelism does not run yet: each refused by name, none ignored. The
  // expert gradients reduce over every rank holding the expert (all its shards, zeros where a
  // rank did not compute), which the settings below would have to follow.
  auto refuse = [&](bool bad, const std::string& what) {
    MOETRAIN_CHECK(!bad, "dist.etp = {} with {}: expert tensor parallelism does not run it yet; {}",
                   d.etp, what, "leave it at its default or set dist.etp = 1");
  };
  refuse(d.pp > 1, fmt::format("dist.pp = {} (pipeline stages)", d.pp));
  refuse(c.train.device != "cpu", fmt::format("train.device = {}", c.train.device));
  refuse(c.train.precision_dtype() != DType::F32,
         fmt::format("train.precision = {} (the experts' low-precision weight copies)",
                     precision_name(c.train.precision)));
  refuse(d.hierarchical, "dist.hierarchical = true (an expert all-to-all route)");
  refuse(d.adaptive_route, "dist.adaptive_route = true (an expert all-to-all route)");
  refuse(d.a2a_chunks > 1, fmt::format("dist.a2a_chunks = {} (chunked exchanges)", d.a2a_chunks));
  refuse(c.train.recompute != Recompute::None, "train.recompute (activation recomputation)");
  refuse(c.placement.enabled(),
         fmt::format("placement.spare_slots = {}", c.placement.spare_slots));
  refuse(d.zero > 0, fmt::format("dist.zero = {}", d.zero));
  refuse(d.local_steps(), "dist.sync = params");
  refuse(d.grad_reduce_dtype == "int8", "dist.grad_reduce_dtype = int8");
  refuse(c.grad.sparse_ratio != 0, fmt::format("grad.sparse_ratio = {}", c.grad.sparse_ratio));
  refuse(c.grad.sparse_experts, "grad.sparse_experts = true");
}

void validate_pipeline(const RunConfig& c) {
  const DistSettings& d = c.dist;
  if (d.pp == 1) return;
  const TrainConfig& t = c.train;
  MOETRAIN_CHECK(d.pp <= c.model.n_layers,
                 "dist.pp = {} with model.n_layers = {}: each pipeline stage needs at least one "
                 "block; use dist.pp ≤ {}",
                 d.pp, c.model.n_layers, c.model.n_layers);
  MOETRAIN_CHECK(d.pp * d.vp <= c.model.n_layers,
                 "dist.pp = {} × dist.vp = {} chunks with model.n_layers = {}: each model chunk "
                 "needs at least one block; lower dist.vp (or dist.pp) so that dist.pp · dist.vp "
                 "≤ {}",
                 d.pp, d.vp, c.model.n_layers, c.model.n_layers);
  const PipeSchedule schedule = parse_pipe_schedule(d.pp_schedule, "dist.pp_schedule");
  if (const std::string why = pipe_shape_problem(schedule, {d.pp, t.grad_accum, d.vp});
      !why.empty())
    MOETRAIN_FAIL("dist.pp = {}, dist.vp = {}, dist.pp_schedule = {}: {}", d.pp, d.vp,
                  d.pp_schedule, why);
  // What the pipeline executor does not run: each refused by name, none ignored.
  auto refuse = [&](bool bad, const std::string& what) {
    MOETRAIN_CHECK(!bad, "dist.pp = {} with {}: the pipeline executor does not run it yet; {}", d.pp,
                   what, "leave it at its default or set dist.pp = 1");
  };
  // ZeRO-1 shards a stage's optimizer state over the stage's copies; ZeRO-2 reduce-scatters the
  // stage's buckets once its last backward (or weight pass) made them final; ZeRO-3 shards the
  // stage's parameters over them too, and every activation slot's model gathers each unit of its
  // chunk where its passes use it (train/pipeline_step.h).
  refuse(d.local_steps(), "dist.sync = params");
  // Expert parallelism runs inside each stage (dist.ep divides the stage's processes, checked
  // where the process groups are made): the flat all-to-all, chunked or not, and the 2-D one. A
  // stage's EP group sees a node's copies of the stage, so a node must hold whole pipelines, or
  // whole parts of one (train/parallel_setup.cpp, make_run_parallel).
  MOETRAIN_CHECK(d.ranks_per_node == 0 || d.ranks_per_node % d.pp == 0 ||
                     d.pp % d.ranks_per_node == 0,
                 "dist.ranks_per_node = {} with dist.pp = {}: a node's processes hold a number of "
                 "each stage's copies only when they hold whole pipelines or parts of one; use a "
                 "dist.ranks_per_node that is a multiple or a divisor of {} (or 0 to detect)",
                 d.ranks_per_node, d.pp, d.pp);
  refuse(d.adaptive_route, "dist.adaptive_route = true (an expert all-to-all route)");
  // int8 and grad.sparse_ratio carry an error-feedback residual per process, which checkpoints
  // keep as the rows of one [world, n] tensor (train/run_state.h); a stage's residual covers its
  // own buckets, so the stages' rows differ in size.
  refuse(d.grad_reduce_dtype == "int8",
         "dist.grad_reduce_dtype = int8 (its error-feedback residual in checkpoints)");
  refuse(t.device != "cpu", fmt::format("train.device = {}", t.device));
  // Recomputation runs in every activation slot (each slot is a model of its own), but full
  // keeps one set of block activations a slot, which zero_bubble's deferred weight gradients
  // would read after the next block's recompute overwrote them.
  refuse(t.recompute == Recompute::Full && schedule == PipeSchedule::ZeroBubble,
         "dist.pp_schedule = zero_bubble and train.recompute = full (its weight passes read "
         "each block's activations; use train.recompute = moe, or the 1f1b schedule)");
  refuse(c.placement.enabled(),
         fmt::format("placement.spare_slots = {}", c.placement.spare_slots));
  refuse(c.grad.sparse_ratio != 0,
         fmt::format("grad.sparse_ratio = {} (its residual in checkpoints)", c.grad.sparse_ratio));
}

}  // namespace moetrain
