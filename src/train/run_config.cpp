#include "train/run_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/log.h"
#include "data/tokenizer.h"
#include "train/precision.h"

namespace moetrain {

void add_optim_fields(std::vector<Field>& fields, OptimSettings& o) {
  const Field optim[] = {
      {"optim.name", &o.name, "The optimizer", "adamw, sgd, adagrad, rmsprop"},
      {"optim.lr", &o.lr, "Peak learning rate, reached after the warmup"},
      {"optim.min_lr", &o.min_lr,
       "Learning rate at the end of the schedule (cosine, linear), in [0, optim.lr]"},
      {"optim.warmup_steps", &o.warmup_steps,
       "Steps of linear warmup from lr / warmup_steps to lr (0 = none)"},
      {"optim.schedule", &o.schedule, "Learning-rate decay after the warmup, down to optim.min_lr",
       "cosine, linear, constant"},
      {"optim.beta1", &o.beta1, "AdamW's first-moment decay, in [0, 1)"},
      {"optim.beta2", &o.beta2, "AdamW's second-moment decay, in [0, 1)"},
      {"optim.eps", &o.eps,
       "Added to the root of the second moment (adamw, adagrad, rmsprop), > 0"},
      {"optim.weight_decay", &o.weight_decay,
       "Decoupled weight decay per step, times the learning rate (≥ 0)"},
      {"optim.momentum", &o.momentum, "Momentum of sgd and rmsprop, in [0, 1)"},
      {"optim.grad_clip", &o.grad_clip, "Clip the global gradient norm to this value (0 = off)"},
  };
  fields.insert(fields.end(), std::begin(optim), std::end(optim));
}

void add_moe_fields(std::vector<Field>& fields, MoeModelConfig& m) {
  const Field moe[] = {
      {"model.expert_hidden", &m.expert_hidden, "F: each expert's SwiGLU hidden size"},
      {"model.n_experts", &m.n_experts, "E: experts per MoE layer"},
      {"model.top_k", &m.top_k, "K: experts each token is sent to, in [1, model.n_experts]"},
      {"model.router", choice(&m.router, parse_router_setting, router_kind_name),
       "How tokens and experts are matched",
       "topk_softmax, noisy_topk, expert_choice, sigmoid_bias"},
      {"model.renormalize", &m.renormalize,
       "Token-choice routers: divide the kept top-k weights by their sum"},
      {"model.capacity_factor", &m.capacity_factor,
       "Expert capacity: > 0 fixed ceil(N·K/E·cf) (tokens over it dropped), 0 dropless, < 0 "
       "min(|cf|, the load needed)"},
      {"model.capacity", choice(&m.capacity, parse_capacity_mode, capacity_mode_name),
       "fixed: capacity_factor as set; dynamic: the [balance] controller moves it each step",
       "fixed, dynamic"},
      {"model.overflow", choice(&m.overflow, parse_overflow, overflow_name),
       "Token choice with a capacity (capacity_factor ≠ 0): drop the assignments over an "
       "expert's capacity, or reroute each to the token's next-best expert with room",
       "drop, reroute"},
      {"model.balance_loss", choice(&m.balance_loss, parse_balance_loss, balance_loss_name),
       "Load-balancing loss of topk_softmax and noisy_topk: Switch's E·Σ f·P, or the variance "
       "of importance and load",
       "switch, variance"},
      {"model.aux_loss_coef", &m.aux_loss_coef,
       "Weight of the load-balancing loss (model.balance_loss; 0 = off)"},
      {"model.z_loss_coef", &m.z_loss_coef,
       "Weight of the router z-loss on the logits' log-sum-exp (0 = off)"},
      {"model.bias_update_rate", &m.bias_update_rate,
       "sigmoid_bias router: step of its per-expert bias toward balance"},
      {"model.router_controller",
       choice(&m.router_controller, parse_router_controller, router_controller_name),
       "sigmoid_bias router: what moves its bias: the sign rule (none) or the [gating] "
       "controller (rl)",
       "none, rl"},
      {"model.shared_expert_hidden", &m.shared_expert_hidden,
       "Hidden size of a shared expert every token also goes through (0 = none)"},
      {"model.route_groups", &m.route_groups,
       "Group-limited routing: the experts form this many contiguous groups (1 = off)"},
      {"model.route_group_topk", &m.route_group_topk,
       "Group-limited routing: groups each token may pick its experts from"},
      {"model.router_skew", &m.router_skew,
       "Zipf skew s of the routing, expert e's logit − s·ln(e + 1), for benchmarks (0 = off)"},
  };
  fields.insert(fields.end(), std::begin(moe), std::end(moe));
}

void add_balance_fields(std::vector<Field>& fields, MoeModelConfig& m) {
  CapacityControlConfig& b = m.balance;
  const Field balance[] = {
      {"balance.cf_min", &b.cf_min, "Dynamic capacity: lowest capacity factor the controller sets"},
      {"balance.cf_max", &b.cf_max,
       "Dynamic capacity: highest capacity factor the controller sets"},
      {"balance.window", &b.window,
       "Dynamic capacity: steps of utilisation its trend is fitted over"},
      {"balance.util_low", &b.util_low,
       "Dynamic capacity: below this utilisation with a high imbalance, shrink"},
      {"balance.util_high", &b.util_high,
       "Dynamic capacity: above this utilisation with a low imbalance, grow"},
      {"balance.imbalance_low", &b.imbalance_low,
       "Dynamic capacity: busiest expert's load / mean below which it may grow"},
      {"balance.imbalance_high", &b.imbalance_high,
       "Dynamic capacity: busiest expert's load / mean above which it may shrink"},
      {"balance.slope_tol", &b.slope_tol,
       "Dynamic capacity: utilisation falling faster than this per step shrinks it"},
  };
  fields.insert(fields.end(), std::begin(balance), std::end(balance));
  GatingControlConfig& g = m.gating;
  const Field gating[] = {
      {"gating.lr", &g.lr, "rl bias controller: policy step size"},
      {"gating.sigma", &g.sigma,
       "rl bias controller: policy standard deviation, in units of bias_update_rate"},
      {"gating.baseline_lr", &g.baseline_lr,
       "rl bias controller: value-baseline step size, in [0, 1]"},
      {"gating.time_decay", &g.time_decay,
       "rl bias controller: decay of its running step-time and tokens/s means"},
  };
  fields.insert(fields.end(), std::begin(gating), std::end(gating));
}

void read_moe_keys_as_now(nlohmann::json& j) {
  if (!j.contains("model") || !j["model"].is_object()) return;
  auto& m = j["model"];
  if (m.contains("route_groups") && m["route_groups"] == 0) m["route_groups"] = 1;
}

void hash_moe_keys_as_before(nlohmann::json& j) {
  if (!j.contains("model")) return;
  nlohmann::json& m = j["model"];
  if (m.value("route_groups", int64_t{0}) == 1) m["route_groups"] = 0;
  // The defaults compute what runs computed before these keys existed.
  if (m.value("overflow", std::string("drop")) == "drop") m.erase("overflow");
  if (m.value("balance_loss", std::string("switch")) == "switch") m.erase("balance_loss");
}

namespace {

ConfigSchema schema(RunConfig& c) {
  ModelConfig& m = c.model;
  TrainConfig& t = c.train;
  std::vector<Field> fields = {
      {"model.vocab_size", &m.vocab_size,
       "V: tokens in the vocabulary; when not set, that of data.dir's tokenizer (256: bytes)"},
      {"model.dim", &m.dim, "C: the model width"},
      {"model.n_layers", &m.n_layers, "L: blocks in the model"},
      {"model.n_heads", &m.n_heads, "NH: attention heads; divides model.dim"},
      {"model.n_kv_heads", &m.n_kv_heads,
       "Key/value heads (grouped-query attention); divides model.n_heads"},
      {"model.norm_eps", &m.norm_eps, "Epsilon of the RMS norms"},
      {"model.init_std", &m.init_std, "Standard deviation of the initial weights"},
  };
  add_moe_fields(fields, m);
  const Field model[] = {
      {"model.dense_every", &m.dense_every,
       "Every n-th block has a dense FFN instead of experts (0 = none)"},
      {"model.dense_hidden", &m.dense_hidden,
       "Hidden size of the dense FFNs (0 = expert_hidden · top_k)"},
      {"model.first_dense_layers", &m.first_dense_layers,
       "The first n blocks have a dense FFN of model.dense_hidden instead of experts (planner "
       "only)"},
      {"model.head_dim", &m.head_size,
       "HS: width of an attention head, apart from model.dim / model.n_heads (0 = that; planner "
       "only unless equal)"},
      {"model.sliding_window", &m.sliding_window,
       "Causal window: a query attends to at most this many keys (0 = all; planner only)"},
      {"model.full_attention_every", &m.full_attention_every,
       "With a window, every n-th block keeps full attention (0 = none; planner only)"},
      {"model.q_lora_rank", &m.q_lora_rank,
       "Multi-head latent attention: rank of the query's down-projection (0 = none; planner only)"},
      {"model.kv_lora_rank", &m.kv_lora_rank,
       "Multi-head latent attention: rank of the key/value latent (0 = no MLA; planner only)"},
      {"model.qk_rope_head_dim", &m.qk_rope_head_dim,
       "Multi-head latent attention: rotary part of a query/key head (planner only)"},
      {"model.qk_nope_head_dim", &m.qk_nope_head_dim,
       "Multi-head latent attention: non-rotary part of a query/key head (planner only)"},
      {"model.v_head_dim", &m.v_head_dim,
       "Multi-head latent attention: width of a value head (planner only)"},
      {"model.max_seq_len", &m.max_seq_len, "Longest sequence the model takes (RoPE table size)"},
      {"model.rope_theta", &m.rope_theta, "Base of the rotary position embedding's frequencies"},
  };
  fields.insert(fields.end(), std::begin(model), std::end(model));
  add_balance_fields(fields, m);
  const Field placement[] = {
      {"placement.spare_slots", &c.placement.spare_slots,
       "Expert slots per process for replicas of the hottest experts (0 = off)"},
      {"placement.every", &c.placement.every, "Re-plan the replicas every this many steps"},
      {"placement.decay", &c.placement.decay,
       "Moving-average decay of the expert loads the plan follows, in [0, 1)"},
  };
  fields.insert(fields.end(), std::begin(placement), std::end(placement));
  add_grad_fields(fields, c.grad);
  add_run_fields(fields, c.data.dir, c.optim, t, c.dist);
  const Field train[] = {
      {"train.seq_len", &t.seq_len, "T: tokens per sequence, at most model.max_seq_len"},
      {"train.grad_accum", &t.grad_accum, "Micro-batches per optimizer step"},
      {"train.eval_batches", &t.eval_batches, "Batches of val.bin each evaluation reads"},
      {"train.keep_checkpoints", &t.keep_checkpoints,
       "Newest checkpoints kept in run_dir/checkpoints (≥ 1)"},
      {"train.precision", choice(&t.precision, parse_precision, precision_name),
       "GEMM operand precision (auto: bf16 where the CPU multiplies bf16 natively, else f32; tf32 "
       "needs cuda)",
       "auto, f32, bf16, fp16, tf32"},
      {"train.device", &t.device, "Where the forward and backward run", "cpu, cuda"},
      {"train.recompute", choice(&t.recompute, parse_recompute, recompute_name),
       "Activation recomputation: none keeps every activation; moe recomputes the experts' "
       "intermediates in backward; full keeps each block's input only and recomputes the block "
       "(same gradients, less memory, more compute; cpu only)",
       "none, moe, full"},
      {"train.loss_scale_init", &t.loss_scale_init, "fp16: initial loss scale"},
      {"train.loss_scale_growth_interval", &t.loss_scale_growth_interval,
       "fp16: steps without overflow before the scale grows"},
      {"train.loss_scale_growth_factor", &t.loss_scale_growth_factor,
       "fp16: factor the scale grows by"},
      {"train.loss_scale_backoff_factor", &t.loss_scale_backoff_factor,
       "fp16: factor the scale shrinks by on an overflow"},
  };
  fields.insert(fields.end(), std::begin(train), std::end(train));
  return ConfigSchema(std::move(fields));
}

}  // namespace

std::vector<std::string> run_config_keys() {
  RunConfig c;
  return schema(c).keys();
}

std::string run_config_help(const std::string& section) {
  RunConfig c;
  return schema(c).describe(section);
}

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  RunConfig c;
  ConfigSchema s = schema(c);
  c.model.vocab_size = 0;  // not set: the data's tokenizer decides, below
  if (!path.empty()) s.apply_toml_file(path);
  s.apply_overrides(overrides);
  if (c.model.vocab_size == 0) c.model.vocab_size = data_vocab_size(c.data.dir);
  c.validate();
  c.train.resolve_precision();
  return c;
}

RunConfig with_overrides(const RunConfig& base, const std::vector<std::string>& overrides) {
  RunConfig c = base;
  schema(c).apply_overrides(overrides);
  c.validate();
  return c;
}

void OptimSettings::validate() const {
  const OptimSettings& o = *this;
  MOETRAIN_CHECK(o.name == "adamw" || o.name == "sgd" || o.name == "adagrad" || o.name == "rmsprop",
                 "optim.name = '{}': allowed are adamw, sgd, adagrad, rmsprop", o.name);
  MOETRAIN_CHECK(o.schedule == "cosine" || o.schedule == "linear" || o.schedule == "constant",
                 "optim.schedule = '{}': allowed are cosine, linear, constant", o.schedule);
  MOETRAIN_CHECK(o.lr > 0, "optim.lr = {}: must be positive", o.lr);
  MOETRAIN_CHECK(o.min_lr >= 0 && o.min_lr <= o.lr,
                 "optim.min_lr = {}: must be in [0, optim.lr = {}]", o.min_lr, o.lr);
  MOETRAIN_CHECK(o.warmup_steps >= 0, "optim.warmup_steps = {}: must be ≥ 0", o.warmup_steps);
  MOETRAIN_CHECK(o.beta1 >= 0 && o.beta1 < 1, "optim.beta1 = {}: must be in [0, 1)", o.beta1);
  MOETRAIN_CHECK(o.beta2 >= 0 && o.beta2 < 1, "optim.beta2 = {}: must be in [0, 1)", o.beta2);
  MOETRAIN_CHECK(o.eps > 0, "optim.eps = {}: must be positive", o.eps);
  MOETRAIN_CHECK(o.weight_decay >= 0, "optim.weight_decay = {}: must be ≥ 0", o.weight_decay);
  MOETRAIN_CHECK(o.momentum >= 0 && o.momentum < 1, "optim.momentum = {}: must be in [0, 1)",
                 o.momentum);
  MOETRAIN_CHECK(o.grad_clip >= 0, "optim.grad_clip = {}: must be ≥ 0 (0 = off)", o.grad_clip);
}

OptimizerConfig OptimSettings::optimizer_config() const {
  OptimizerConfig oc = default_optimizer_config(name);
  oc.beta1 = beta1;
  oc.beta2 = beta2;
  oc.eps = eps;
  oc.weight_decay = weight_decay;
  if (oc.kind == OptimizerKind::Sgd || oc.kind == OptimizerKind::RmsProp) oc.momentum = momentum;
  oc.validate();
  return oc;
}

ScheduleConfig OptimSettings::schedule_config(int64_t total_steps) const {
  ScheduleConfig sc;
  sc.kind = parse_schedule_kind(schedule);
  sc.lr = lr;
  sc.min_lr = min_lr;
  sc.warmup_steps = std::min(warmup_steps, total_steps);
  // Warmup starts at lr / warmup_steps rather than 0, so the first step is not wasted.
  sc.warmup_init = sc.warmup_steps > 0 ? lr / static_cast<double>(sc.warmup_steps) : lr;
  sc.total_steps = total_steps;
  return sc;
}

void RunConfig::validate() const {
  model.validate();
  const TrainConfig& t = train;
  validate_loop(t);
  MOETRAIN_CHECK(t.seq_len > 0 && t.seq_len <= model.max_seq_len,
                 "train.seq_len = {}: must be in [1, model.max_seq_len = {}]", t.seq_len,
                 model.max_seq_len);
  // A step is at least one forward and backward per micro-batch: beyond 65,536 a step would take
  // hours on any model (larger batches come from more processes or train.batch_size).
  MOETRAIN_CHECK(t.grad_accum > 0 && t.grad_accum <= 65536,
                 "train.grad_accum = {}: must be in 1..65536", t.grad_accum);
  MOETRAIN_CHECK(t.eval_batches > 0, "train.eval_batches = {}: must be positive", t.eval_batches);
  MOETRAIN_CHECK(t.keep_checkpoints >= 1, "train.keep_checkpoints = {}: must be ≥ 1",
                 t.keep_checkpoints);
  if (t.precision == Precision::FP16) t.loss_scale().validate();
  MOETRAIN_CHECK(t.device == "cpu" || t.device == "cuda",
                 "train.device = '{}': allowed are cpu, cuda", t.device);
  MOETRAIN_CHECK(t.precision != Precision::TF32 || t.device == "cuda",
                 "train.precision = tf32 rounds GEMM operands on a GPU's tensor cores: it needs "
                 "train.device = cuda");
  if (t.device == "cuda") {
    // What the CUDA backend does not run yet: each is refused by name rather than run elsewhere.
    MOETRAIN_CHECK(t.recompute == Recompute::None,
                   "train.device = cuda with train.recompute = {}: the CUDA backend keeps every "
                   "activation; allowed there is none (recompute runs on the CPU)",
                   recompute_name(t.recompute));
    MOETRAIN_CHECK(t.precision != Precision::FP16,
                   "train.device = cuda with train.precision = fp16: the CUDA backend computes in "
                   "f32, tf32 or bf16 (auto picks bf16)");
    MOETRAIN_CHECK(dist.ep <= 1 && !dist.zero && !dist.local_steps(),
                   "train.device = cuda runs on one process (no NCCL backend yet): leave dist.ep, "
                   "dist.zero and dist.sync at their defaults");
    MOETRAIN_CHECK(!placement.enabled(),
                   "train.device = cuda: expert replication (placement.*) runs on the CPU only");
    MOETRAIN_CHECK(optim.name == "adamw",
                   "train.device = cuda: the update runs on the GPU with AdamW; optim.name = {} "
                   "runs on the CPU only",
                   optim.name);
    MOETRAIN_CHECK(grad.expert_reweight == "none",
                   "train.device = cuda: grad.expert_reweight runs on the CPU only");
    MOETRAIN_CHECK(!grad.sparse_experts,
                   "train.device = cuda: grad.sparse_experts runs on the CPU only (the device "
                   "backward zeroes and sums every gradient)");
    MOETRAIN_CHECK(grad.sparse_ratio == 0,
                   "train.device = cuda with grad.sparse_ratio = {}: the device runs one process, "
                   "which reduces no gradients; set grad.sparse_ratio = 0",
                   grad.sparse_ratio);
  }
  optim.validate();
  dist.validate();
  dist.validate_offload(t.run_dir, t.device);
  // Checkpoints are taken right after an averaging, when every replica holds the same values.
  MOETRAIN_CHECK(!dist.local_steps() || t.checkpoint_every % dist.sync_every == 0,
                 "train.checkpoint_every = {} with dist.sync = params: must be a multiple of "
                 "dist.sync_every = {} (checkpoints are written right after an averaging)",
                 t.checkpoint_every, dist.sync_every);
  MOETRAIN_CHECK(!(dist.local_steps() && t.precision == Precision::FP16),
                 "dist.sync = params with train.precision = fp16: each replica would skip steps "
                 "and move its loss scale on its own; use train.precision = bf16 or f32");
  // The error-feedback residual would carry loss-scaled gradients across changes of the scale.
  MOETRAIN_CHECK(!(dist.grad_reduce_dtype == "int8" && t.precision == Precision::FP16),
                 "dist.grad_reduce_dtype = int8 with train.precision = fp16: the error-feedback "
                 "residual cannot follow the loss scale; use train.precision = bf16 or f32, or "
                 "dist.grad_reduce_dtype = bf16");
  if (model.n_moe_layers() > 0) placement.validate(model.n_experts, dist.ep);
  MOETRAIN_CHECK(!(dist.zero == 3 && placement.enabled()),
                 "dist.zero = 3 with placement.spare_slots = {}: replicas are copied from whole "
                 "expert weights, which ZeRO-3 shards; use dist.zero = 2 or placement.spare_slots "
                 "= 0",
                 placement.spare_slots);
  grad.validate();
  grad.validate_reduction(dist, t.precision == Precision::FP16);
  MOETRAIN_CHECK(grad.expert_reweight == "none" || model.n_moe_layers() > 0,
                 "grad.expert_reweight = '{}' needs a model with MoE layers", grad.expert_reweight);
  validate_pipeline(*this);
  validate_tensor_parallel(*this);
  validate_expert_tensor_parallel(*this);
}

void TrainConfig::resolve_precision() {
  if (precision != Precision::Auto) return;
  precision_was_auto = true;
  if (device == "cuda") {
    precision = resolve_auto(device, "");
    log_info("train.precision = auto: bf16 (train.device = cuda: bf16 GEMMs on the tensor cores)");
    return;
  }
  // Resolved once and recorded as the run's own value: config.json, the checkpoints and the
  // config hash say what the run computed, not what "auto" would pick on another machine.
  const std::string isa = onednn_cpu_isa();
  precision = resolve_auto(device, isa);
  log_info("train.precision = auto: {} (oneDNN dispatches to {}{})", precision_name(precision), isa,
           has_native_bf16(isa) ? ", a native bf16 matmul" : ", no native bf16 matmul");
}

LossScaleConfig TrainConfig::loss_scale() const {
  LossScaleConfig c;
  c.init = loss_scale_init;
  c.growth_interval = loss_scale_growth_interval;
  c.growth_factor = loss_scale_growth_factor;
  c.backoff_factor = loss_scale_backoff_factor;
  return c;
}

RunConfig run_config_from_json(const nlohmann::json& j, const std::string& where) {
  RunConfig c;
  nlohmann::json now = j;
  read_moe_keys_as_now(now);
  schema(c).apply_json(now, where);
  c.validate();
  return c;
}

nlohmann::json RunConfig::to_json() const {
  RunConfig copy = *this;
  return schema(copy).to_json();
}

std::string RunConfig::config_hash() const {
  nlohmann::json j = to_json();
  // What may change between a run and its resumption without changing what is computed.
  // grad_accum: a resumed run on another process count sets it to keep the global batch, which
  // the checkpoint records and the resume checks instead.
  // device: the GPU computes what the CPU computes (to rounding), so a run may resume on either.
  // recompute: every mode computes the same bits.
  for (const char* k :
       {"steps", "grad_accum", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints",
        "threads", "run_dir", "progress", "tensorboard", "device", "profile",
        "recompute"})
    j["train"].erase(k);
  j.erase("data");
  j.erase("dist");
  // Replicas compute what their logical experts compute, and checkpoints hold logical experts.
  j.erase("placement");
  // f32 runs hash as they did before mixed precision existed (their checkpoints still resume);
  // the loss-scale settings only matter in fp16.
  if (train.precision != Precision::FP16) {
    for (const char* k : {"loss_scale_init", "loss_scale_growth_interval",
                          "loss_scale_growth_factor", "loss_scale_backoff_factor"})
      j["train"].erase(k);
  }
  // tf32 hashes as f32: its f32 storage resumes on a CPU, which computes f32.
  if (train.precision == Precision::F32 || train.precision == Precision::TF32)
    j["train"].erase("precision");
  // Likewise fixed-capacity runs: the controller's settings do not touch them.
  if (model.capacity == CapacityMode::Fixed) {
    j["model"].erase("capacity");
    j.erase("balance");
  }
  // Likewise unskewed routers (the benchmark knob came later than many checkpoints).
  if (model.router_skew == 0) j["model"].erase("router_skew");
  // Runs without the [grad] options hash as they did before the section existed.
  erase_inert_grad_keys(j, grad);
  if (model.router_controller == RouterControllerKind::None) {
    j["model"].erase("router_controller");
    j.erase("gating");
  }
  hash_moe_keys_as_before(j);
  // Planner-only shapes (the trainer refuses them, ModelConfig::check_trainable) at their
  // defaults: checkpoints made before the keys existed hash as they did.
  for (const char* k : {"first_dense_layers", "head_dim", "sliding_window", "full_attention_every",
                        "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                        "v_head_dim"})
    if (j["model"].value(k, int64_t{0}) == 0) j["model"].erase(k);
  std::string s = j.dump();
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return fmt::format("{:016x}", h);
}

}  // namespace moetrain
