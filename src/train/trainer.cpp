#include "train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/fault.h"
#include "core/log.h"
#include "core/threads.h"
#include "core/timer.h"
#include "data/loader.h"
#include "data/shard.h"
#include "model/params.h"
#include "optim/clip.h"
#include "optim/param_groups.h"
#include "parallel/alltoall.h"
#include "parallel/comm_thread.h"
#include "parallel/moe_exchange_setup.h"
#include "parallel/grad_sync.h"
#include "parallel/groups.h"
#include "parallel/runtime.h"
#include "parallel/sharded_optimizer.h"
#include "train/evaluate.h"
#include "train/progress.h"

namespace fs = std::filesystem;

namespace moetrain {

namespace {

std::string router_bias_name(int64_t layer) {
  return fmt::format("model.layers.{}.block_sparse_moe.router_bias", layer);
}

std::vector<NamedTensor> model_views(const ParamLayout& layout, float* params) {
  std::vector<NamedTensor> out;
  for (const auto& p : layout.params()) out.push_back({p.name, p.shape, params + p.offset});
  return out;
}

// Router biases of the aux-loss-free router: state, not parameters.
std::vector<NamedTensor> bias_views(Transformer& model) {
  std::vector<NamedTensor> out;
  const ModelConfig& cfg = model.config();
  if (cfg.moe().router != RouterKind::SigmoidBias) return out;
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    int64_t m = model.moe_index(l);
    if (m >= 0)
      out.push_back({router_bias_name(l), {cfg.n_experts}, model.moe_layers()[m]->router_bias()});
  }
  return out;
}

std::unique_ptr<TokenShard> open_shard(const DataConfig& data, const char* file) {
  fs::path p = fs::path(data.dir) / file;
  MOETRAIN_CHECK(fs::is_regular_file(p),
                 "data.dir = '{}' has no {}: prepare it first, e.g. `moetrain prepare --input "
                 "/usr/share/games/fortunes --out {}`",
                 data.dir, file, data.dir);
  return std::make_unique<TokenShard>(p);
}

// Which rank writes each tensor of the layout (layout order) into checkpoints: an expert's, a rank
// of the EDP group that holds it (experts spread over its DP ranks); a replicated tensor, the
// rank with the fewest bytes so far, biggest tensors first, so that all ranks write about as much.
std::vector<int> checkpoint_writers(const ParamLayout& layout, const ParallelLayout& pl,
                                    int64_t E) {
  const std::vector<ParamInfo>& params = layout.params();
  std::vector<int> writer(params.size(), 0);
  std::vector<int64_t> bytes(static_cast<std::size_t>(pl.world), 0);
  std::vector<std::size_t> replicated;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamInfo& p = params[i];
    if (p.expert < 0) {
      replicated.push_back(i);
      continue;
    }
    const int ep_index = static_cast<int>(p.expert / (E / pl.ep));
    const int dp_index = static_cast<int>(p.expert % pl.dp);
    writer[i] = dp_index * pl.ep + ep_index;
    bytes[writer[i]] += p.numel;
  }
  std::stable_sort(replicated.begin(), replicated.end(),
                   [&](std::size_t a, std::size_t b) { return params[a].numel > params[b].numel; });
  for (std::size_t i : replicated) {
    writer[i] = static_cast<int>(std::min_element(bytes.begin(), bytes.end()) - bytes.begin());
    bytes[writer[i]] += params[i].numel;
  }
  return writer;
}

double imbalance(const std::vector<int64_t>& load) {
  if (load.empty()) return 1.0;
  int64_t mx = 0, sum = 0;
  for (int64_t v : load) mx = std::max(mx, v), sum += v;
  return sum > 0
             ? static_cast<double>(mx) * static_cast<double>(load.size()) / static_cast<double>(sum)
             : 1.0;
}

}  // namespace

LoadedModel load_model(const fs::path& dir) {
  fs::path ckpt = dir;
  if (!fs::is_regular_file(dir / "manifest.json")) {
    auto latest = find_latest_checkpoint(dir);
    MOETRAIN_CHECK(latest.has_value(),
                   "{}: neither a checkpoint directory nor a run directory with a complete "
                   "checkpoint",
                   dir.string());
    ckpt = *latest;
  }
  nlohmann::json config = read_checkpoint_json(ckpt, "config.json");
  MOETRAIN_CHECK(config.contains("moetrain"),
                 "{}/config.json: no 'moetrain' section (not written by moetrain)", ckpt.string());
  LoadedModel out;
  out.config = run_config_from_json(config["moetrain"], (ckpt / "config.json").string());
  out.model = std::make_unique<Transformer>(out.config.model);
  out.params.assign(static_cast<std::size_t>(out.model->layout().size()), 0.0f);
  CheckpointContents c;
  c.model = model_views(out.model->layout(), out.params.data());
  c.state = bias_views(*out.model);
  read_checkpoint(ckpt, c);
  out.step = c.trainer.value("step", int64_t{0});
  log_info("loaded {} (step {})", ckpt.string(), out.step);
  return out;
}

Trainer::Trainer(RunConfig cfg, bool resume, std::unique_ptr<Comm> world) : cfg_(std::move(cfg)) {
  cfg_.validate();
  world_ = world ? std::move(world) : dist_world("trainer");
  const int W = world_->size();
  int threads = init_threads(static_cast<int>(cfg_.train.threads), W > 1 ? dist_local_size() : 1);
  pg_ =
      std::make_unique<ProcessGroups>(make_process_groups(*world_, static_cast<int>(cfg_.dist.ep)));
  const ParallelLayout& pl = pg_->layout;
  ExpertShard& shard = expert_shard_;
  shard = {0, cfg_.model.n_experts};
  MoeContext moe_ctx;
  if (W > 1) {
    if (cfg_.model.n_moe_layers() > 0)
      shard = expert_shard(cfg_.model.n_experts, pl.ep, pl.ep_index);
    ExpertParallelSetup ep = make_expert_parallel(
        {cfg_.dist.hierarchical, static_cast<int>(cfg_.dist.ranks_per_node),
         static_cast<int>(cfg_.dist.a2a_chunks), parse_dtype(cfg_.dist.a2a_dtype, "dist.a2a_dtype"),
         cfg_.dist.overlap},
        *pg_);
    moe_ctx = ep.context(*pg_);
    hier_ = std::move(ep.hierarchy), comm_thread_ = std::move(ep.comm_thread);
    exchange_ = std::move(ep.exchange);
  }
  model_ = std::make_unique<Transformer>(cfg_.model, moe_ctx);
  model_->set_precision(cfg_.train.precision_dtype());
  if (cfg_.train.precision_dtype() == DType::F16)
    scaler_ = std::make_unique<LossScaler>(cfg_.train.loss_scale());
  const ParamLayout& layout = model_->layout();
  params_.assign(static_cast<std::size_t>(layout.size()), 0.0f);
  grads_.assign(params_.size(), 0.0f);
  init_params(params_.data(), layout, cfg_.model, cfg_.train.seed);
  groups_ = param_groups(layout);

  const OptimizerConfig oc = cfg_.optim.optimizer_config();
  SyncRanges ranges = sync_ranges(layout, shard);
  for (const FlatRange& r : ranges.expert) own_experts_.push_back({r.offset, r.size});
  std::vector<OptimPiece> pieces;
  if (W == 1) {
    pieces.push_back({0, layout.size()});
  } else {
    GradSyncConfig gc;
    gc.first_bucket_bytes = static_cast<int64_t>(cfg_.dist.bucket_first_mb * 1024 * 1024);
    gc.bucket_bytes = static_cast<int64_t>(cfg_.dist.bucket_mb * 1024 * 1024);
    gc.reduce_dtype = parse_dtype(cfg_.dist.grad_reduce_dtype, "dist.grad_reduce_dtype");
    sync_ = std::make_unique<GradSync>(ranges, *pg_->grads, *pg_->expert_grads, gc);
    if (cfg_.dist.overlap)
      model_->set_grads_ready_hook([this](int64_t from) { sync_->ready(from); });
    if (cfg_.dist.zero == 1) {
      for (const ShardPiece& p : sync_->shard_pieces())
        pieces.push_back({p.range.offset, p.range.size});
    } else {
      for (const FlatRange& r : ranges.dense) pieces.push_back({r.offset, r.size});
      for (const FlatRange& r : ranges.expert) pieces.push_back({r.offset, r.size});
    }
  }
  optimizer_ = std::make_unique<ShardedOptimizer>(oc, groups_, std::move(pieces));
  writers_ = checkpoint_writers(layout, pl, cfg_.model.n_experts);

  schedule_ = std::make_unique<LrSchedule>(cfg_.optim.schedule_config(cfg_.train.steps));

  train_shard_ = open_shard(cfg_.data, "train.bin");
  val_shard_ = open_shard(cfg_.data, "val.bin");
  MOETRAIN_CHECK(train_shard_->vocab() <= static_cast<uint32_t>(cfg_.model.vocab_size),
                 "{} has vocabulary {}, larger than model.vocab_size = {}",
                 train_shard_->path().string(), train_shard_->vocab(), cfg_.model.vocab_size);
  MOETRAIN_CHECK(train_shard_->size() > static_cast<uint64_t>(cfg_.train.seq_len) + 1,
                 "{} has {} tokens, too few for train.seq_len = {}", train_shard_->path().string(),
                 train_shard_->size(), cfg_.train.seq_len);
  const int64_t BT = cfg_.train.batch_size * cfg_.train.seq_len;
  inputs_.resize(static_cast<std::size_t>(BT));
  targets_.resize(static_cast<std::size_t>(BT));

  if (pl.rank == 0) fs::create_directories(cfg_.train.run_dir);
  pg_->control->barrier();
  // A fresh run never overwrites (or prunes) another run's checkpoints.
  MOETRAIN_CHECK(
      resume || !fs::exists(fs::path(cfg_.train.run_dir) / "checkpoints"),
      "train.run_dir = '{}' already holds a run's checkpoints: pass --resume to continue it, or "
      "choose another train.run_dir (or remove that one)",
      cfg_.train.run_dir);
  // Collective: every rank gets the same checkpoint (or none).
  std::optional<fs::path> ckpt =
      resume ? find_latest_checkpoint(cfg_.train.run_dir, pg_->control.get()) : std::nullopt;
  if (ckpt) {
    load_checkpoint(*ckpt);
  } else {
    // Committed checkpoints that all fail verification are not silently replaced: a run from
    // step 0 would prune them. (An uncommitted .tmp_ directory is no checkpoint.)
    int64_t refused = 0;
    const fs::path cdir = fs::path(cfg_.train.run_dir) / "checkpoints";
    if (resume && fs::is_directory(cdir))
      for (const auto& entry : fs::directory_iterator(cdir))
        if (entry.is_directory() && entry.path().filename().string().rfind("step_", 0) == 0)
          ++refused;
    MOETRAIN_CHECK(refused == 0,
                   "{} holds {} checkpoint(s) and none can be loaded (the reasons are logged "
                   "above): move them away to start this run from step 0, or point "
                   "train.run_dir elsewhere",
                   cdir.string(), refused);
    if (resume) log_info("no checkpoint in {}: starting from step 0", cfg_.train.run_dir);
    if (pl.rank == 0)
      std::ofstream(fs::path(cfg_.train.run_dir) / "metrics.jsonl", std::ios::trunc);
  }
  check_ranks_agree();
  if (pl.rank == 0)
    write_file_atomic(fs::path(cfg_.train.run_dir) / "config.json", cfg_.to_json().dump(2) + "\n");

  int64_t n_params = layout.size();
  log_info(
      "model: {} layers, {} experts (top-{}), {:.2f}M parameters, {:.1f} MFLOP/token; {} threads",
      cfg_.model.n_layers, cfg_.model.n_experts, cfg_.model.top_k,
      static_cast<double>(n_params) / 1e6, model_->flops_per_token(cfg_.train.seq_len) / 1e6,
      threads);
  log_info("data: {} train / {} val tokens; {} tokens per step", train_shard_->size(),
           val_shard_->size(), BT * cfg_.train.grad_accum * W);
  if (W > 1)
    log_info(
        "{} processes: {} data-parallel x {} expert-parallel ({} experts each){}{}; {} gradient "
        "buckets",
        W, pl.dp, pl.ep, shard.count, cfg_.dist.zero ? ", ZeRO-1" : "",
        hier_ ? fmt::format(", 2-D all-to-all ({} ranks per node)", hier_->intra->size()) : "",
        sync_->buckets().size());
}

int Trainer::rank() const {
  return world_->rank();
}
int Trainer::world_size() const {
  return world_->size();
}
bool Trainer::distributed() const {
  return world_->size() > 1;
}

Trainer::~Trainer() = default;

CheckpointShare Trainer::checkpoint_share(bool reading) {
  CheckpointShare share;
  const std::vector<ParamInfo>& params = model_->layout().params();
  const int me = rank();
  auto holds = [&](const ParamInfo& p) {
    return p.expert < 0 || (p.expert >= expert_shard_.first &&
                            p.expert < expert_shard_.first + expert_shard_.count);
  };
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamInfo& p = params[i];
    if (reading ? holds(p) : writers_[i] == me)
      share.model.push_back(whole_tensor(p.name, p.shape, params_.data() + p.offset));
  }
  // Optimizer state by parameter name and element range: this rank's pieces cut at tensor
  // boundaries (the alignment gaps between tensors hold no state worth keeping: always zero).
  // Under ZeRO-1 the pieces of all ranks tile the buffer; otherwise state is replicated like the
  // parameters and each tensor's writer saves it.
  const bool sharded = distributed() && cfg_.dist.zero == 1;
  const std::vector<std::string>& names = optimizer_->state_names();
  const std::vector<OptimPiece>& pieces = optimizer_->pieces();
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    const int64_t from = pieces[k].offset, to = from + pieces[k].size;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const ParamInfo& p = params[i];
      const int64_t lo = std::max(from, p.offset), hi = std::min(to, p.offset + p.numel);
      if (lo >= hi || (!reading && !sharded && writers_[i] != me)) continue;
      for (std::size_t s = 0; s < names.size(); ++s)
        share.optimizer.push_back(
            {names[s] + "." + p.name, p.shape, lo - p.offset, hi - p.offset,
             optimizer_->piece_state(k, static_cast<int>(s)).data() + (lo - from)});
    }
  }
  if (reading || me == 0)
    for (const NamedTensor& t : bias_views(*model_))
      share.state.push_back(whole_tensor(t.name, t.shape, t.data));
  return share;
}

nlohmann::json Trainer::trainer_state() const {
  const int64_t B = cfg_.train.batch_size, A = cfg_.train.grad_accum, W = world_size();
  nlohmann::json t = {
      {"step", step_},
      {"config_hash", cfg_.config_hash()},
      {"seed", cfg_.train.seed},
      {"optimizer", {{"name", cfg_.optim.name}, {"step_count", optimizer_->step_count()}}},
      {"schedule",
       {{"position", step_}, {"total_steps", cfg_.train.steps}, {"next_lr", schedule_->lr(step_)}}},
      // Batches are a pure function of (seed, step, row of the global batch): the next step and
      // the global batch say where the data stands, whatever the layout.
      {"data",
       {{"next_step", step_},
        {"global_batch", B * A * W},
        {"batch_size", B},
        {"seq_len", cfg_.train.seq_len},
        {"train_tokens", train_shard_->size()}}},
      // Every random stream is counter-based (seed, step, purpose): the seed and the step are
      // the whole generator state.
      {"rng", {{"seed", cfg_.train.seed}, {"next_step", step_}}},
      {"layout",
       {{"processes", W},
        {"ep", pg_->layout.ep},
        {"dp", pg_->layout.dp},
        {"zero", cfg_.dist.zero},
        {"grad_accum", A}}}};
  if (scaler_) {
    t["loss_scale"] = {{"scale", scaler_->raw_scale()},
                       {"good_steps", scaler_->good_steps()},
                       {"skipped_steps", scaler_->skipped_steps()}};
  }
  return t;
}

CheckpointDocs Trainer::checkpoint_docs() const {
  nlohmann::json hf = cfg_.model.to_hf_json();
  if (std::string why; !cfg_.model.hf_mixtral_compatible(&why)) {
    // Claiming Mixtral would let transformers load this model and compute something else (drop
    // the shared expert or dense layers with a mere warning, route differently): name our own
    // architecture and type so that AutoModel refuses it, and say why in the file itself.
    hf["architectures"] = {"MoetrainForCausalLM"};
    hf["model_type"] = "moetrain";
    hf["moetrain_note"] = fmt::format("not loadable as transformers' MixtralForCausalLM: {}", why);
  }
  hf["moetrain"] = cfg_.to_json();
  return {hf, trainer_state()};
}

fs::path Trainer::save_checkpoint() {
  // Every rank writes its own pieces; the checkpoint is complete when any rank returns.
  return write_checkpoint(*pg_->control, cfg_.train.run_dir, step_, checkpoint_share(false),
                          checkpoint_docs(), cfg_.train.keep_checkpoints);
}

void Trainer::restore_trainer_state(const nlohmann::json& t, const fs::path& dir) {
  const std::string where = (dir / "trainer_state.json").string();
  auto need = [&](const nlohmann::json& j, const char* key) -> const nlohmann::json& {
    MOETRAIN_CHECK(j.is_object() && j.contains(key), "{}: no '{}'", where, key);
    return j.at(key);
  };
  const std::string hash = need(t, "config_hash").get<std::string>();
  MOETRAIN_CHECK(hash == cfg_.config_hash(),
                 "{} was written with a different configuration (hash {} vs this run's {}): resume "
                 "with the same model, optimizer and batch settings, or use a new train.run_dir",
                 dir.string(), hash, cfg_.config_hash());
  step_ = need(t, "step").get<int64_t>();
  optimizer_->set_step_count(need(need(t, "optimizer"), "step_count").get<int64_t>());
  if (scaler_ && t.contains("loss_scale")) {
    const nlohmann::json& ls = t["loss_scale"];
    scaler_->restore(ls.value("scale", 1.0), ls.value("good_steps", int64_t{0}),
                     ls.value("skipped_steps", int64_t{0}));
  }

  // The global batch stays what it was: a different number of processes changes the number of
  // micro-batches per step (the windows of a step do not depend on how they are split).
  const nlohmann::json& data = need(t, "data");
  const int64_t global = need(data, "global_batch").get<int64_t>();
  const int64_t per_micro = cfg_.train.batch_size * world_size();
  MOETRAIN_CHECK(global > 0 && global % per_micro == 0,
                 "{} was trained with a global batch of {} sequences per step; {} processes x "
                 "train.batch_size {} = {} sequences per micro-batch do not divide it: resume on a "
                 "process count that does",
                 dir.string(), global, world_size(), cfg_.train.batch_size, per_micro);
  if (global / per_micro != cfg_.train.grad_accum)
    log_info(
        "train.grad_accum = {} instead of {}: {} processes keep the global batch of {} "
        "sequences per step",
        global / per_micro, cfg_.train.grad_accum, world_size(), global);
  cfg_.train.grad_accum = global / per_micro;
  if (data.value("train_tokens", uint64_t{0}) != train_shard_->size())
    log_warn("{}: the training data had {} tokens, {} has {}: batches will differ", where,
             data.value("train_tokens", uint64_t{0}), train_shard_->path().string(),
             train_shard_->size());
}

void Trainer::load_checkpoint(const fs::path& dir) {
  restore_trainer_state(read_checkpoint_json(dir, "trainer_state.json"), dir);
  // Each rank reads the ranges it holds, from whichever files hold them.
  read_checkpoint_pieces(dir, checkpoint_share(true));
  model_->weights_changed();  // the low-precision weight copies follow the loaded weights
  if (rank() != 0) return;
  // Metrics past the checkpoint belong to a run that is being replaced.
  fs::path mpath = fs::path(cfg_.train.run_dir) / "metrics.jsonl";
  std::vector<std::string> keep;
  if (std::ifstream in(mpath); in) {
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.value("step", int64_t{0}) <= step_) keep.push_back(line);
    }
  }
  std::ofstream out(mpath, std::ios::trunc);
  for (const auto& line : keep) out << line << "\n";
  log_info("resumed from {} at step {}", dir.string(), step_);
}

void Trainer::check_ranks_agree() {
  Comm& comm = *pg_->control;
  if (comm.size() == 1) return;
  const uint64_t hash = std::stoull(cfg_.config_hash(), nullptr, 16);
  std::vector<int64_t> hashes = comm.allgather_one(static_cast<int64_t>(hash));
  std::vector<int64_t> steps = comm.allgather_one(step_);
  for (int q = 1; q < comm.size(); ++q) {
    MOETRAIN_CHECK(hashes[q] == hashes[0],
                   "rank {} has configuration hash {:016x}, rank 0 has {:016x}: every process "
                   "must run the same model, optimizer and batch settings",
                   q, static_cast<uint64_t>(hashes[q]), static_cast<uint64_t>(hashes[0]));
    MOETRAIN_CHECK(steps[q] == steps[0],
                   "rank {} starts at step {}, rank 0 at step {}: the processes resumed from "
                   "different checkpoints",
                   q, steps[q], steps[0]);
  }
}

double Trainer::train_step() {
  const int64_t B = cfg_.train.batch_size, T = cfg_.train.seq_len, A = cfg_.train.grad_accum;
  const int64_t E = cfg_.model.n_experts;
  const int W = world_size();
  BatchLoader loader(*train_shard_, B, T, cfg_.train.seed, rank(), W);
  std::fill(grads_.begin(), grads_.end(), 0.0f);
  const int64_t sync_bytes_before = sync_ ? sync_->bytes_sent() : 0;
  LossParts sum;
  auto moe = model_->moe_layers();
  std::vector<std::vector<int64_t>> load(moe.size(),
                                         std::vector<int64_t>(static_cast<std::size_t>(E), 0));
  std::vector<double> dropped(moe.size(), 0.0);
  last_a2a_s_ = 0, last_a2a_wait_s_ = 0;
  // The gradient of the mean over every process's micro-batches: summing the ranks' gradients
  // (the reduction) then gives the mean.
  // fp16: the loss is scaled so that small gradients survive the fp16 GEMM operands.
  last_scale_ = scaler_ ? scaler_->scale() : 1.0;
  last_skipped_ = false;
  const float loss_weight = static_cast<float>(last_scale_) / static_cast<float>(A * W);
  for (int64_t micro = 0; micro < A; ++micro) {
    loader.fill(step_, micro, inputs_.data(), targets_.data());
    MoeStep ms;
    ms.training = true;
    ms.seed = cfg_.train.seed;
    ms.step = static_cast<uint64_t>(step_ * A + micro);
    ms.token_offset = static_cast<uint64_t>(rank() * B * T);  // this rank's rows of the batch
    LossParts p = model_->forward(params_.data(), inputs_.data(), targets_.data(), B, T, ms);
    MOETRAIN_CHECK(std::isfinite(p.total),
                   "step {}: the loss is {} (cross-entropy {}, aux {}, z {}); stopping. The last "
                   "good checkpoint "
                   "is kept in {}/checkpoints; lower optim.lr or raise optim.warmup_steps",
                   step_ + 1, p.total, p.ce, p.aux, p.z, cfg_.train.run_dir);
    // The last micro-batch's backward finishes the gradients: reduce buckets as they complete.
    if (W > 1 && cfg_.dist.overlap && micro == A - 1)
      sync_->begin(*comm_thread_, grads_.data(), /*gather=*/cfg_.dist.zero == 0);
    model_->backward(params_.data(), grads_.data(), loss_weight);
    sum.ce += p.ce / A, sum.aux += p.aux / A, sum.z += p.z / A, sum.total += p.total / A;
    sum.targets += p.targets;
    for (std::size_t m = 0; m < moe.size(); ++m) {
      const MoeStats& s = moe[m]->stats();
      for (int64_t e = 0; e < E; ++e) load[m][e] += s.tokens_per_expert[e];
      dropped[m] += s.fraction_dropped / static_cast<double>(A * W);
      last_a2a_s_ += moe[m]->timings().a2a;
      last_a2a_wait_s_ += moe[m]->timings().a2a_wait;
    }
  }
  last_lr_ = schedule_->lr(step_);
  if (W == 1) {
    const int64_t n = static_cast<int64_t>(grads_.size());
    const bool bad = has_non_finite(grads_.data(), n);
    if (scaler_) {
      last_skipped_ = !scaler_->update(bad);
      if (!last_skipped_) scale_gradients(grads_.data(), n, static_cast<float>(1.0 / last_scale_));
    } else {
      MOETRAIN_CHECK(!bad,
                     "step {}: non-finite gradient; stopping. The last good checkpoint is kept in "
                     "{}/checkpoints",
                     step_ + 1, cfg_.train.run_dir);
    }
    if (!last_skipped_) {
      last_grad_norm_ = cfg_.optim.grad_clip > 0
                            ? clip_grad_norm(grads_.data(), n, cfg_.optim.grad_clip)
                            : grad_norm(grads_.data(), n);
      optimizer_->step(params_.data(), grads_.data(), static_cast<float>(last_lr_));
    }
  } else {
    distributed_update(static_cast<float>(last_lr_));
  }
  if (last_skipped_) {
    log_warn("step {}: fp16 gradients overflowed at loss scale {}; step skipped, scale now {}",
             step_ + 1, last_scale_, scaler_->raw_scale());
  } else {
    model_->weights_changed();
  }
  if (cfg_.model.moe().router == RouterKind::SigmoidBias && !moe.empty()) {
    std::vector<int64_t> global(moe.size() * E);
    for (std::size_t m = 0; m < moe.size(); ++m)
      std::copy_n(moe[m]->pending_load(), E, global.begin() + m * E);
    pg_->control->allreduce(global.data(), static_cast<int64_t>(global.size()));
    for (std::size_t m = 0; m < moe.size(); ++m) moe[m]->apply_bias_update(global.data() + m * E);
  }
  ++step_;
  if (W > 1) {
    // Every rank's losses are means over the same number of tokens: their mean is the global one.
    double parts[4] = {sum.ce, sum.aux, sum.z, sum.total};
    pg_->control->allreduce(parts, 4);
    sum.ce = parts[0] / W, sum.aux = parts[1] / W, sum.z = parts[2] / W, sum.total = parts[3] / W;
    pg_->control->allreduce(&sum.targets, 1);
    std::vector<int64_t> flat;
    for (const auto& l : load) flat.insert(flat.end(), l.begin(), l.end());
    pg_->control->allreduce(flat.data(), static_cast<int64_t>(flat.size()));
    for (std::size_t m = 0; m < moe.size(); ++m)
      std::copy_n(flat.begin() + m * E, E, load[m].begin());
    pg_->control->allreduce(dropped.data(), static_cast<int64_t>(dropped.size()));
  }
  last_parts_ = sum;

  nlohmann::json line = {{"step", step_},
                         {"loss", sum.total},
                         {"ce", sum.ce},
                         {"aux", sum.aux},
                         {"z", sum.z},
                         {"lr", last_lr_},
                         {"grad_norm", last_grad_norm_}};
  if (scaler_) {
    line["loss_scale"] = last_scale_;
    line["skipped"] = last_skipped_;
  }
  if (sync_) line["grad_sync_bytes"] = sync_->bytes_sent() - sync_bytes_before;
  line["tokens_per_expert"] = load;
  line["dropped_fraction"] = dropped;
  double imb = 0;
  for (const auto& l : load) imb += imbalance(l);
  line["imbalance"] = moe.empty() ? 1.0 : imb / static_cast<double>(moe.size());
  pending_metrics_ = line;
  return sum.total;
}

void Trainer::distributed_update(float lr) {
  const double sync_before = sync_->seconds();
  Timer wall;
  double update_s = 0;
  // Plain DP: the reduced gradients are gathered into grads_ before any scaling (during
  // backward with overlap, right after the reduce-scatter without), and the unscale and clip
  // multiply them in place: the same bits either way, whatever the wire type. ZeRO-1 scales the
  // shard it updates.
  const bool plain = cfg_.dist.zero == 0;
  if (cfg_.dist.overlap) {
    sync_->finish();
  } else {
    sync_->reduce_scatter(grads_.data());
    if (plain) sync_->allgather_grads(grads_.data());
  }
  auto scale = [&](double factor) {
    sync_->scale_shard(static_cast<float>(factor));  // the norm is taken over the shard
    if (plain) sync_->scale_reduced(grads_.data(), static_cast<float>(factor));
  };
  // Every element of the global gradient lies in exactly one rank's shard: the norm and the
  // non-finite check are sums over shards, the same bits on every rank.
  int64_t bad = sync_->shard_has_non_finite() ? 1 : 0;
  pg_->control->allreduce(&bad, 1);
  if (scaler_) {
    // The summed flag: every rank takes the same decision and keeps the same scale.
    last_skipped_ = !scaler_->update(bad > 0);
    if (last_skipped_) {
      last_sync_s_ = sync_->seconds() - sync_before;
      last_sync_exposed_s_ = wall.seconds();
      return;
    }
    scale(1.0 / last_scale_);
  }
  MOETRAIN_CHECK(
      bad == 0,
      "step {}: non-finite gradient on {} process(es); stopping. The last good checkpoint is "
      "kept in {}/checkpoints",
      step_ + 1, bad, cfg_.train.run_dir);
  double sq = sync_->shard_sum_squares();
  pg_->control->allreduce(&sq, 1);
  last_grad_norm_ = std::sqrt(sq);
  if (cfg_.optim.grad_clip > 0) {
    const double coef = clip_coefficient(last_grad_norm_, cfg_.optim.grad_clip);
    if (coef != 1.0) scale(coef);
  }
  if (!plain) {
    sync_->unpack_shard(grads_.data());
    {
      ScopedTimer timer(update_s);
      optimizer_->step(params_.data(), grads_.data(), lr);
    }
    sync_->allgather_params(params_.data());
  } else {
    ScopedTimer timer(update_s);
    optimizer_->step(params_.data(), grads_.data(), lr);
  }
  last_sync_s_ = sync_->seconds() - sync_before;
  last_sync_exposed_s_ = wall.seconds() - update_s;
}

void Trainer::write_metrics_line(const nlohmann::json& line) {
  if (rank() != 0) return;
  std::ofstream out(fs::path(cfg_.train.run_dir) / "metrics.jsonl", std::ios::app);
  out << line.dump() << "\n";
}

TrainResult Trainer::run(int64_t stop_at) {
  TrainResult result;
  result.first_step = step_;
  const int64_t total = stop_at >= 0 ? std::min(stop_at, cfg_.train.steps) : cfg_.train.steps;
  const double tokens_per_step = static_cast<double>(cfg_.train.batch_size * cfg_.train.seq_len *
                                                     cfg_.train.grad_accum * world_size());
  Progress progress(parse_progress_mode(rank() == 0 ? cfg_.train.progress : "off"), step_,
                    cfg_.train.steps);
  Timer run_timer;
  double train_seconds = 0;
  while (step_ < total) {
    Timer t;
    result.final_loss = train_step();
    fault_point("step", step_);
    double dt = t.seconds();
    train_seconds += dt;
    pending_metrics_["step_time_s"] = dt;
    pending_metrics_["tokens_per_s"] = tokens_per_step / dt;
    // Exposed: the time the step waited for communication (all-to-alls not hidden behind expert
    // compute; the gradient reduction not hidden behind backward, and its all-gather).
    const double exposed = last_a2a_wait_s_ + last_sync_exposed_s_;
    const double compute = std::max(0.0, dt - exposed);
    pending_metrics_["a2a_s"] = last_a2a_s_;
    pending_metrics_["grad_sync_s"] = last_sync_s_;
    pending_metrics_["exposed_comm_s"] = exposed;
    pending_metrics_["compute_s"] = compute;
    pending_metrics_["comm_efficiency"] =
        compute + exposed > 0 ? compute / (compute + exposed) : 1.0;
    write_metrics_line(pending_metrics_);
    progress.update({step_, cfg_.train.steps, result.final_loss, tokens_per_step / dt, last_lr_,
                     pending_metrics_["imbalance"].get<double>()});
    bool last = step_ == total;
    if (cfg_.train.eval_every > 0 && step_ % cfg_.train.eval_every == 0 && !last) {
      result.val_loss = evaluate(*model_, params_.data(), *val_shard_, cfg_.train.batch_size,
                                 cfg_.train.seq_len, cfg_.train.eval_batches, pg_->control.get());
      write_metrics_line({{"step", step_}, {"val_loss", result.val_loss}});
      progress.note(
          fmt::format("step {}: validation loss {:.4f} nats/byte", step_, result.val_loss));
    }
    if (cfg_.train.checkpoint_every > 0 && step_ % cfg_.train.checkpoint_every == 0 && !last) {
      result.last_checkpoint = save_checkpoint();
      progress.note(fmt::format("step {}: checkpoint {}", step_, result.last_checkpoint.string()));
    }
  }
  progress.finish();
  result.steps_done = step_ - result.first_step;
  result.seconds = run_timer.seconds();
  result.tokens_per_s =
      train_seconds > 0 ? tokens_per_step * static_cast<double>(result.steps_done) / train_seconds
                        : 0.0;
  result.val_loss = evaluate(*model_, params_.data(), *val_shard_, cfg_.train.batch_size,
                             cfg_.train.seq_len, cfg_.train.eval_batches, pg_->control.get());
  write_metrics_line({{"step", step_}, {"val_loss", result.val_loss}});
  result.last_checkpoint = save_checkpoint();
  log_info(
      "done: {} steps in {:.1f} s ({:.0f} tokens/s); validation loss {:.4f} nats/byte; checkpoint "
      "{}",
      result.steps_done, result.seconds, result.tokens_per_s, result.val_loss,
      result.last_checkpoint.string());
  return result;
}

}  // namespace moetrain
