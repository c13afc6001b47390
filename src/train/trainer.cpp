#include "train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/log.h"
#include "core/threads.h"
#include "core/timer.h"
#include "data/loader.h"
#include "data/shard.h"
#include "model/params.h"
#include "optim/clip.h"
#include "train/progress.h"

namespace fs = std::filesystem;

namespace moetrain {

std::vector<ParamRange> param_groups(const ParamLayout& layout) {
  std::vector<const ParamInfo*> sorted;
  for (const auto& p : layout.params()) sorted.push_back(&p);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  std::vector<ParamRange> groups;
  int64_t at = 0;
  for (const ParamInfo* p : sorted) {
    if (p->offset > at) groups.push_back({at, p->offset - at, false});
    groups.push_back({p->offset, p->numel, p->decay});
    at = p->offset + p->numel;
  }
  if (layout.size() > at) groups.push_back({at, layout.size() - at, false});
  return groups;
}

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
    if (m >= 0) out.push_back({router_bias_name(l), {cfg.n_experts}, model.moe_layers()[m]->router_bias()});
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

double imbalance(const std::vector<int64_t>& load) {
  if (load.empty()) return 1.0;
  int64_t mx = 0, sum = 0;
  for (int64_t v : load) mx = std::max(mx, v), sum += v;
  return sum > 0 ? static_cast<double>(mx) * static_cast<double>(load.size()) / static_cast<double>(sum) : 1.0;
}

}  // namespace

double evaluate(Transformer& model, const float* params, const TokenShard& shard, int64_t B, int64_t T,
                int64_t max_batches) {
  EvalLoader loader(shard, B, T, max_batches);
  std::vector<int32_t> inputs(static_cast<std::size_t>(B * T)), targets(inputs.size());
  double sum = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < loader.num_batches(); ++i) {
    int64_t rows = loader.fill(i, inputs.data(), targets.data());
    if (rows == 0) continue;
    std::fill(targets.begin() + rows * T, targets.end(), -1);  // rows past the data count nothing
    MoeStep step;
    step.training = false;
    LossParts parts = model.forward(params, inputs.data(), targets.data(), B, T, step);
    sum += parts.ce * static_cast<double>(parts.targets);
    count += parts.targets;
  }
  MOETRAIN_CHECK(count > 0, "validation shard {} has too few tokens for one window of {}", shard.path().string(), T);
  return sum / static_cast<double>(count);
}

LoadedModel load_model(const fs::path& dir) {
  fs::path ckpt = dir;
  if (!fs::is_regular_file(dir / "manifest.json")) {
    auto latest = find_latest_checkpoint(dir);
    MOETRAIN_CHECK(latest.has_value(), "{}: neither a checkpoint directory nor a run directory with a complete "
                                       "checkpoint", dir.string());
    ckpt = *latest;
  }
  verify_checkpoint(ckpt);
  nlohmann::json config = read_checkpoint_json(ckpt, "config.json");
  MOETRAIN_CHECK(config.contains("moetrain"), "{}/config.json: no 'moetrain' section (not written by moetrain)",
                 ckpt.string());
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

Trainer::Trainer(RunConfig cfg, bool resume) : cfg_(std::move(cfg)) {
  cfg_.validate();
  int threads = init_threads(static_cast<int>(cfg_.train.threads));
  model_ = std::make_unique<Transformer>(cfg_.model);
  const ParamLayout& layout = model_->layout();
  params_.assign(static_cast<std::size_t>(layout.size()), 0.0f);
  grads_.assign(params_.size(), 0.0f);
  init_params(params_.data(), layout, cfg_.model, cfg_.train.seed);
  groups_ = param_groups(layout);

  OptimizerConfig oc = default_optimizer_config(cfg_.optim.name);
  oc.beta1 = cfg_.optim.beta1;
  oc.beta2 = cfg_.optim.beta2;
  oc.eps = cfg_.optim.eps;
  oc.weight_decay = cfg_.optim.weight_decay;
  if (oc.kind == OptimizerKind::Sgd || oc.kind == OptimizerKind::RmsProp) oc.momentum = cfg_.optim.momentum;
  oc.validate();
  optimizer_ = make_optimizer(oc, groups_, 0, layout.size());

  ScheduleConfig sc;
  sc.kind = parse_schedule_kind(cfg_.optim.schedule);
  sc.lr = cfg_.optim.lr;
  sc.min_lr = cfg_.optim.min_lr;
  sc.warmup_steps = std::min(cfg_.optim.warmup_steps, cfg_.train.steps);
  // Warmup starts at lr / warmup_steps rather than 0, so the first step is not wasted.
  sc.warmup_init = sc.warmup_steps > 0 ? cfg_.optim.lr / static_cast<double>(sc.warmup_steps) : cfg_.optim.lr;
  sc.total_steps = cfg_.train.steps;
  schedule_ = std::make_unique<LrSchedule>(sc);

  train_shard_ = open_shard(cfg_.data, "train.bin");
  val_shard_ = open_shard(cfg_.data, "val.bin");
  MOETRAIN_CHECK(train_shard_->vocab() <= static_cast<uint32_t>(cfg_.model.vocab_size),
                 "{} has vocabulary {}, larger than model.vocab_size = {}", train_shard_->path().string(),
                 train_shard_->vocab(), cfg_.model.vocab_size);
  MOETRAIN_CHECK(train_shard_->size() > static_cast<uint64_t>(cfg_.train.seq_len) + 1,
                 "{} has {} tokens, too few for train.seq_len = {}", train_shard_->path().string(),
                 train_shard_->size(), cfg_.train.seq_len);
  const int64_t BT = cfg_.train.batch_size * cfg_.train.seq_len;
  inputs_.resize(static_cast<std::size_t>(BT));
  targets_.resize(static_cast<std::size_t>(BT));

  fs::create_directories(cfg_.train.run_dir);
  std::optional<fs::path> ckpt = resume ? find_latest_checkpoint(cfg_.train.run_dir) : std::nullopt;
  if (ckpt) {
    load_checkpoint(*ckpt);
  } else {
    if (resume) log_info("no checkpoint in {}: starting from step 0", cfg_.train.run_dir);
    std::ofstream(fs::path(cfg_.train.run_dir) / "metrics.jsonl", std::ios::trunc);
  }
  write_file_atomic(fs::path(cfg_.train.run_dir) / "config.json", cfg_.to_json().dump(2) + "\n");

  int64_t n_params = layout.size();
  log_info("model: {} layers, {} experts (top-{}), {:.2f}M parameters, {:.1f} MFLOP/token; {} threads",
           cfg_.model.n_layers, cfg_.model.n_experts, cfg_.model.top_k, static_cast<double>(n_params) / 1e6,
           model_->flops_per_token(cfg_.train.seq_len) / 1e6, threads);
  log_info("data: {} train / {} val tokens; {} tokens per step", train_shard_->size(), val_shard_->size(),
           BT * cfg_.train.grad_accum);
}

Trainer::~Trainer() = default;

CheckpointContents Trainer::checkpoint_views() {
  CheckpointContents c;
  const ParamLayout& layout = model_->layout();
  c.model = model_views(layout, params_.data());
  for (const StateBuffer& sb : optimizer_->state()) {
    for (const auto& p : layout.params())
      c.optimizer.push_back({sb.name + "." + p.name, p.shape, sb.values.data() + p.offset});
  }
  c.state = bias_views(*model_);
  nlohmann::json hf = cfg_.model.to_hf_json();
  hf["moetrain"] = cfg_.to_json();
  c.config = hf;
  c.trainer = {{"step", step_},
               {"config_hash", cfg_.config_hash()},
               {"seed", cfg_.train.seed},
               {"optimizer", {{"name", cfg_.optim.name}, {"step_count", optimizer_->step_count()}}},
               {"data", {{"next_step", step_}, {"train_tokens", train_shard_->size()}}}};
  return c;
}

fs::path Trainer::save_checkpoint() {
  fs::path dir = write_checkpoint(cfg_.train.run_dir, step_, checkpoint_views(), cfg_.train.keep_checkpoints);
  return dir;
}

void Trainer::load_checkpoint(const fs::path& dir) {
  CheckpointContents c = checkpoint_views();
  read_checkpoint(dir, c);
  std::string hash = c.trainer.value("config_hash", std::string());
  MOETRAIN_CHECK(hash == cfg_.config_hash(),
                 "{} was written with a different configuration (hash {} vs this run's {}): resume with the same "
                 "model, optimizer and batch settings, or use a new train.run_dir",
                 dir.string(), hash, cfg_.config_hash());
  step_ = c.trainer.value("step", int64_t{0});
  optimizer_->set_step_count(c.trainer["optimizer"].value("step_count", int64_t{0}));
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

double Trainer::train_step() {
  const int64_t B = cfg_.train.batch_size, T = cfg_.train.seq_len, A = cfg_.train.grad_accum;
  const int64_t E = cfg_.model.n_experts;
  BatchLoader loader(*train_shard_, B, T, cfg_.train.seed);
  std::fill(grads_.begin(), grads_.end(), 0.0f);
  LossParts sum;
  auto moe = model_->moe_layers();
  std::vector<std::vector<int64_t>> load(moe.size(), std::vector<int64_t>(static_cast<std::size_t>(E), 0));
  std::vector<double> dropped(moe.size(), 0.0);
  for (int64_t micro = 0; micro < A; ++micro) {
    loader.fill(step_, micro, inputs_.data(), targets_.data());
    MoeStep ms;
    ms.training = true;
    ms.seed = cfg_.train.seed;
    ms.step = static_cast<uint64_t>(step_ * A + micro);
    LossParts p = model_->forward(params_.data(), inputs_.data(), targets_.data(), B, T, ms);
    MOETRAIN_CHECK(std::isfinite(p.total),
                   "step {}: the loss is {} (cross-entropy {}, aux {}, z {}); stopping. The last good checkpoint "
                   "is kept in {}/checkpoints; lower optim.lr or raise optim.warmup_steps",
                   step_ + 1, p.total, p.ce, p.aux, p.z, cfg_.train.run_dir);
    model_->backward(params_.data(), grads_.data(), 1.0f / static_cast<float>(A));
    sum.ce += p.ce / A, sum.aux += p.aux / A, sum.z += p.z / A, sum.total += p.total / A;
    sum.targets += p.targets;
    for (std::size_t m = 0; m < moe.size(); ++m) {
      const MoeStats& s = moe[m]->stats();
      for (int64_t e = 0; e < E; ++e) load[m][e] += s.tokens_per_expert[e];
      dropped[m] += s.fraction_dropped / static_cast<double>(A);
    }
  }
  const int64_t n = static_cast<int64_t>(grads_.size());
  MOETRAIN_CHECK(!has_non_finite(grads_.data(), n),
                 "step {}: non-finite gradient; stopping. The last good checkpoint is kept in {}/checkpoints",
                 step_ + 1, cfg_.train.run_dir);
  last_grad_norm_ = cfg_.optim.grad_clip > 0 ? clip_grad_norm(grads_.data(), n, cfg_.optim.grad_clip)
                                             : grad_norm(grads_.data(), n);
  last_lr_ = schedule_->lr(step_);
  optimizer_->step(params_.data(), grads_.data(), static_cast<float>(last_lr_));
  if (cfg_.model.moe().router == RouterKind::SigmoidBias)
    for (MoeBlock* m : moe) m->apply_bias_update(m->pending_load());
  ++step_;
  last_parts_ = sum;

  nlohmann::json line = {{"step", step_},       {"loss", sum.total},  {"ce", sum.ce},
                         {"aux", sum.aux},      {"z", sum.z},         {"lr", last_lr_},
                         {"grad_norm", last_grad_norm_}};
  line["tokens_per_expert"] = load;
  line["dropped_fraction"] = dropped;
  double imb = 0;
  for (const auto& l : load) imb += imbalance(l);
  line["imbalance"] = moe.empty() ? 1.0 : imb / static_cast<double>(moe.size());
  pending_metrics_ = line;
  return sum.total;
}

void Trainer::write_metrics_line(const nlohmann::json& line) {
  std::ofstream out(fs::path(cfg_.train.run_dir) / "metrics.jsonl", std::ios::app);
  out << line.dump() << "\n";
}

TrainResult Trainer::run(int64_t stop_at) {
  TrainResult result;
  result.first_step = step_;
  const int64_t total = stop_at >= 0 ? std::min(stop_at, cfg_.train.steps) : cfg_.train.steps;
  const double tokens_per_step =
      static_cast<double>(cfg_.train.batch_size * cfg_.train.seq_len * cfg_.train.grad_accum);
  Progress progress(parse_progress_mode(cfg_.train.progress), step_, cfg_.train.steps);
  Timer run_timer;
  double train_seconds = 0;
  while (step_ < total) {
    Timer t;
    result.final_loss = train_step();
    double dt = t.seconds();
    train_seconds += dt;
    pending_metrics_["step_time_s"] = dt;
    pending_metrics_["tokens_per_s"] = tokens_per_step / dt;
    write_metrics_line(pending_metrics_);
    progress.update({step_, cfg_.train.steps, result.final_loss, tokens_per_step / dt, last_lr_,
                     pending_metrics_["imbalance"].get<double>()});
    bool last = step_ == total;
    if (cfg_.train.eval_every > 0 && step_ % cfg_.train.eval_every == 0 && !last) {
      result.val_loss = evaluate(*model_, params_.data(), *val_shard_, cfg_.train.batch_size, cfg_.train.seq_len,
                                 cfg_.train.eval_batches);
      write_metrics_line({{"step", step_}, {"val_loss", result.val_loss}});
      progress.note(fmt::format("step {}: validation loss {:.4f} nats/byte", step_, result.val_loss));
    }
    if (cfg_.train.checkpoint_every > 0 && step_ % cfg_.train.checkpoint_every == 0 && !last) {
      result.last_checkpoint = save_checkpoint();
      progress.note(fmt::format("step {}: checkpoint {}", step_, result.last_checkpoint.string()));
    }
  }
  progress.finish();
  result.steps_done = step_ - result.first_step;
  result.seconds = run_timer.seconds();
  result.tokens_per_s = train_seconds > 0 ? tokens_per_step * static_cast<double>(result.steps_done) / train_seconds
                                          : 0.0;
  result.val_loss = evaluate(*model_, params_.data(), *val_shard_, cfg_.train.batch_size, cfg_.train.seq_len,
                             cfg_.train.eval_batches);
  write_metrics_line({{"step", step_}, {"val_loss", result.val_loss}});
  result.last_checkpoint = save_checkpoint();
  log_info("done: {} steps in {:.1f} s ({:.0f} tokens/s); validation loss {:.4f} nats/byte; checkpoint {}",
           result.steps_done, result.seconds, result.tokens_per_s, result.val_loss, result.last_checkpoint.string());
  return result;
}

}  // namespace moetrain
