#include "ps/worker_step.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "core/check.h"
#include "core/log.h"
#include "data/loader.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "optim/param_groups.h"
#include "optim/update.h"
#include "ps/capacity_rounds.h"
#include "train/accumulate.h"
#include "train/evaluate.h"
#include "train/lm_checkpoint.h"
#include "train/run_state.h"
#include "train/step_finish.h"

namespace fs = std::filesystem;

namespace moetrain::ps {

namespace {

// [0, n) without `holes` (sorted, disjoint).
std::vector<Span> complement(const std::vector<Span>& holes, int64_t n) {
  std::vector<Span> out;
  int64_t at = 0;
  for (const Span& h : holes) {
    if (h.offset > at) out.push_back({at, h.offset - at});
    at = std::max(at, h.offset + h.size);
  }
  if (at < n) out.push_back({at, n - at});
  return out;
}

// Elements [from, to) of the concatenation of `spans`, as flat ranges.
std::vector<Span> slice(const std::vector<Span>& spans, int64_t from, int64_t to) {
  std::vector<Span> out;
  int64_t at = 0;
  for (const Span& s : spans) {
    const int64_t lo = std::max(from, at), hi = std::min(to, at + s.size);
    if (lo < hi) out.push_back({s.offset + lo - at, hi - lo});
    at += s.size;
  }
  return out;
}

void sort_spans(std::vector<Span>& spans) {
  std::sort(spans.begin(), spans.end(),
            [](const Span& x, const Span& y) { return x.offset < y.offset; });
}

// packed = flat's elements in `spans`, one after another; unpack is its inverse.
void pack(const std::vector<Span>& spans, const float* flat, float* packed) {
  for (const Span& s : spans) packed = std::copy_n(flat + s.offset, s.size, packed);
}
void unpack(const std::vector<Span>& spans, const float* packed, float* flat) {
  for (const Span& s : spans) {
    std::copy_n(packed, s.size, flat + s.offset);
    packed += s.size;
  }
}

// A group rank's part of the group's gradient, for the check and the clip of a local step: its
// experts and its chunk of the reduced dense gradient (flat ranges, sorted), so that every element
// lies in one rank's part and the ranks' sums over the group's communicator are the group's.
class SpansGradient final : public GradientShard {
 public:
  SpansGradient(float* g, const std::vector<Span>& spans) : g_(g), spans_(spans) {}
  bool has_non_finite() const override {
    for (const Span& s : spans_)
      if (part(s).has_non_finite()) return true;
    return false;
  }
  double sum_squares() const override {
    double q = 0;
    for (const Span& s : spans_) q += part(s).sum_squares();
    return q;
  }
  void scale(float factor) override {
    for (const Span& s : spans_) part(s).scale(factor);
  }
  void range_sums(const std::vector<WeightedRange>& ranges, double* abs_sum,
                  double* sq_sum) const override {
    for (const Span& s : spans_) part(s).range_sums(ranges, abs_sum, sq_sum);
  }
  void scale_ranges(const std::vector<WeightedRange>& ranges) override {
    for (const Span& s : spans_) part(s).scale_ranges(ranges);
  }

 private:
  FlatGradient part(const Span& s) const { return {g_ + s.offset, s.size, s.offset}; }
  float* g_;
  const std::vector<Span>& spans_;
};

}  // namespace

WorkerStep::WorkerStep(const RunConfig& cfg, const PsOptions& opts, int64_t index,
                       const WorkerGroup* group)
    : cfg_(cfg), opts_(opts), index_(index) {
  group_ = group;
  model_ = std::make_unique<Transformer>(cfg_.model, group_ ? group_->moe : MoeContext{});
  model_->set_precision(cfg_.train.precision_dtype());  // f32 or bf16 (check_ps_run_config)
  // The job's keys: the parameters, then the router biases (job_keys, ps/options.h).
  params_.assign(static_cast<std::size_t>(job_keys(cfg_)), 0.0f);
  grads_.assign(params_.size(), 0.0f);
  // A worker started in place of a dead one begins with a zero residual: see docs/ps.md.
  if (opts_.compression() == Encoding::Int8) residual_.assign(params_.size(), 0.0f);
  tokenizer_ = data_tokenizer(cfg_.data.dir);
  train_ = open_token_shards(cfg_.data.dir, cfg_.model.vocab_size, cfg_.train.seq_len,
                             /*want_val=*/false)
               .train;
  windows_ = std::make_unique<WindowStream>(*train_, cfg_.train.seq_len, cfg_.train.seed);
  if (group_) make_group_keys();
  if (group_ && cfg_.placement.enabled()) {
    // As the step engine places them over its EP group (a communicator of the placement's own).
    placement_ = std::make_unique<ExpertPlacement>(cfg_.placement, *model_, cfg_.model.moe(),
                                                   group_->comm->dup("replicas"),
                                                   cfg_.dist.ranks_per_node);
    model_->set_grads_ready_hook(placement_->grads_ready({}, grads_.data()));
  }
  if (cfg_.model.capacity == CapacityMode::Dynamic) {
    capacity_.assign(model_->moe_layers().size(),
                     CapacityController(cfg_.model.balance, std::abs(cfg_.model.capacity_factor)));
    apply_capacity_factors(capacity_, model_->moe_layers());
  }
  if (expert_count_keys(cfg_) > 0)
    counts_ = std::make_unique<SparseExperts>(
        model_->layout(), static_cast<int64_t>(model_->moe_layers().size()), cfg_.model.n_experts,
        cfg_.train.grad_accum, cfg_.grad.min_accum_fraction);
}

bool WorkerStep::placed_by_scheduler() const {
  return placement_ && opts_.consistency_kind() == Consistency::Sync;
}

void WorkerStep::place(int64_t clock, const nlohmann::json& loads) {
  if (loads.empty()) {
    placement_->refresh(params_.data());
    return;
  }
  const auto summed = loads.get<std::vector<std::vector<int64_t>>>();
  MOETRAIN_CHECK(summed.size() == model_->moe_layers().size(),
                 "the scheduler's loads hold {} MoE layers, the model has {}", summed.size(),
                 model_->moe_layers().size());
  // `clock` clocks are done, as the trainer's step count after its step.
  placement_->after_step(clock, summed, params_.data());
}

void WorkerStep::set_capacity(const nlohmann::json& state) {
  MOETRAIN_CHECK(state.is_array() && state.size() == capacity_.size(),
                 "the scheduler's capacity factors hold {} states for {} MoE layers",
                 state.is_array() ? state.size() : 0, capacity_.size());
  for (std::size_t m = 0; m < capacity_.size(); ++m)
    capacity_[m].restore(state[m], "the scheduler's capacity factors");
  apply_capacity_factors(capacity_, model_->moe_layers());
}

void WorkerStep::make_group_keys() {
  const int64_t E = cfg_.model.n_experts, per = cfg_.model.expert_hidden * cfg_.model.dim;
  std::vector<Span> blocks, experts;
  for (const MoeBlockRef& block : model_->moe_blocks())
    for (int64_t base : {block.offsets.w1, block.offsets.w3, block.offsets.w2}) {
      blocks.push_back({base, E * per});
      experts.push_back({base + group_->expert_first * per, group_->expert_count * per});
    }
  sort_spans(blocks);
  dense_keys_ = complement(blocks, static_cast<int64_t>(params_.size()));
  int64_t nd = 0;
  for (const Span& s : dense_keys_) nd += s.size;
  const int P = group_->comm->size(), r = group_->comm->rank();
  chunk_counts_.clear();
  for (int q = 0; q < P; ++q)
    chunk_counts_.push_back(chunk_begin(nd, q + 1, P) - chunk_begin(nd, q, P));
  chunk_keys_ = slice(dense_keys_, chunk_begin(nd, r, P), chunk_begin(nd, r + 1, P));
  keys_ = experts;
  keys_.insert(keys_.end(), chunk_keys_.begin(), chunk_keys_.end());
  sort_spans(keys_);
  dense_.assign(static_cast<std::size_t>(nd), 0.0f);
  chunk_.assign(static_cast<std::size_t>(chunk_counts_[static_cast<std::size_t>(r)]), 0.0f);
}

int64_t WorkerStep::pulled(int64_t clock, bool fresh) {
  if (!group_) return clock;
  pack(chunk_keys_, params_.data(), chunk_.data());
  group_->comm->allgather(dense_.data(), chunk_.data(), chunk_counts_);
  unpack(dense_keys_, dense_.data(), params_.data());
  group_->comm->allreduce(&clock, 1, {ReduceOp::Max});
  if (placed_by_scheduler()) {
    // A later pull's replicas are re-planned and refreshed in place(), after the clock's round.
    if (fresh) placement_->refresh(params_.data());
  } else if (placement_ && (fresh || placement_loads_.empty())) {
    placement_->refresh(params_.data());
  } else if (placement_) {
    // `clock` steps are done, as the trainer's step count after its step.
    placement_->after_step(clock, placement_loads_, params_.data());
  }
  placement_loads_.clear();
  return clock;
}

void WorkerStep::reduce_group(const Accumulated& acc) {
  // Dense key k of rank q's chunk: Σ over the ranks in rank order of their rows' gradients, which
  // rank q alone pushes; the servers then sum the groups' pushes in worker-index order.
  pack(dense_keys_, grads_.data(), dense_.data());
  group_->comm->reduce_scatter(chunk_.data(), dense_.data(), chunk_counts_);
  unpack(chunk_keys_, chunk_.data(), grads_.data());
  std::vector<Span> keep = chunk_keys_;
  const int64_t E = cfg_.model.n_experts, per = cfg_.model.expert_hidden * cfg_.model.dim;
  // The tokens every expert got from the whole group: an expert of this rank that got none from
  // any rank has an exactly zero gradient, which a sparse push leaves out.
  const std::vector<MoeBlockRef> blocks = model_->moe_blocks();
  std::vector<int64_t> load(blocks.size() * static_cast<std::size_t>(E), 1);
  if (opts_.sparse_push) {
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      const std::vector<int64_t>& l =
          acc.tokens_per_expert[static_cast<std::size_t>(model_->moe_index(blocks[b].layer))];
      std::copy(l.begin(), l.end(), load.begin() + static_cast<std::ptrdiff_t>(b) * E);
    }
    group_->comm->allreduce(load.data(), static_cast<int64_t>(load.size()));
  }
  for (std::size_t b = 0; b < blocks.size(); ++b)
    for (int64_t e = group_->expert_first; e < group_->expert_first + group_->expert_count; ++e)
      if (load[b * static_cast<std::size_t>(E) + static_cast<std::size_t>(e)] > 0)
        for (int64_t base : {blocks[b].offsets.w1, blocks[b].offsets.w3, blocks[b].offsets.w2})
          keep.push_back({base + e * per, per});
  sort_spans(keep);
  skip_ = complement(keep, static_cast<int64_t>(grads_.size()));
}

Accumulated WorkerStep::accumulate_rows(int64_t clock, const RowAssignment& a,
                                         float loss_weight) {
  const int64_t T = cfg_.train.seq_len, A = cfg_.train.grad_accum, R = a.rows;
  // The parameters changed in place since the last forward (a pull, a local step): with bf16 the
  // model's rounded weight copies must follow them.
  model_->weights_changed();
  inputs_.resize(static_cast<std::size_t>(R * T));
  targets_.resize(inputs_.size());
  AccumulateArgs<TokenBatch> args;
  args.micro_batches = A;
  args.loss_weight = loss_weight;
  args.fill = [&](int64_t micro) {
    // Row r of the global batch is the window the single-process run reads for its row r, so the
    // workers of a step read disjoint windows, and an epoch's windows once between them.
    for (int64_t b = 0; b < R; ++b)
      windows_->read(stream_position(clock, micro, a.row_begin + b, a.global_rows, A),
                     inputs_.data() + b * T, targets_.data() + b * T);
    return TokenBatch{inputs_.data(), targets_.data(), R, T};
  };
  // This worker's rows start at row_begin of the global batch.
  args.moe_step = [&](int64_t micro) {
    return micro_batch_step(cfg_.train.seed, clock, A, micro, a.row_begin * T);
  };
  args.bad_loss = [&](const LossParts& p) {
    return fmt::format(
        "clock {}: the loss is {} on worker {}; stopping. Lower optim.lr or raise "
        "optim.warmup_steps",
        clock, p.total, index_);
  };
  set_router_biases();
  args.sparse = counts_.get();
  Accumulated acc =
      accumulate(*model_, params_.data(), grads_.data(), model_->layout().size(), args);
  push_expert_loads();
  push_expert_counts();
  return acc;
}

// sigmoid_bias: the model routes with the biases pulled with the parameters (the keys past
// them), which the server holding them stepped with every worker's loads of the last clock.
void WorkerStep::set_router_biases() {
  if (cfg_.model.router != RouterKind::SigmoidBias) return;
  const float* b = params_.data() + model_->layout().size();
  const int64_t E = cfg_.model.n_experts;
  for (MoeLayer* m : model_->moe_layers()) {
    std::copy_n(b, E, m->router_bias());
    b += E;
  }
}

// The push's router bias keys carry this worker's expert loads of the clock (token counts, exact
// in f32), which the server sums over the workers; the model's own counts are cleared (adding
// nothing to its biases), as a trainer's bias update clears them.
void WorkerStep::push_expert_loads() {
  if (cfg_.model.router != RouterKind::SigmoidBias) return;
  float* g = grads_.data() + model_->layout().size();
  const int64_t E = cfg_.model.n_experts;
  const std::vector<double> none(static_cast<std::size_t>(E), 0.0);
  for (MoeLayer* m : model_->moe_layers()) {
    for (int64_t e = 0; e < E; ++e) g[e] = static_cast<float>(m->pending_load()[e]);
    m->apply_bias_delta(none.data());
    g += E;
  }
}

// The expert count keys (after the router bias keys) carry this worker's tokens per expert of
// each micro-batch of the clock, as integers (exact in f32: check_ps_run_config bounds them).
void WorkerStep::push_expert_counts() {
  if (!counts_) return;
  float* g = grads_.data() + model_->layout().size() + router_bias_keys(cfg_);
  for (int64_t c : counts_->counts()) *g++ = static_cast<float>(c);
}

PushMeta WorkerStep::compute(int64_t clock, const RowAssignment& a) {
  const int64_t A = cfg_.train.grad_accum, R = a.rows, E = cfg_.model.n_experts;
  // This worker's rows' share of the global batch: the servers sum the workers' pushes.
  const Accumulated acc = accumulate_rows(
      clock, a, static_cast<float>(static_cast<double>(R) / static_cast<double>(a.global_rows * A)));
  if (!capacity_.empty() || placed_by_scheduler()) capacity_figures_ = ps::capacity_figures(acc);
  if (placement_ && !placed_by_scheduler()) {
    // The clock's loads over the group's ranks (each counted the tokens it routed).
    placement_loads_ = acc.tokens_per_expert;
    for (std::vector<int64_t>& l : placement_loads_)
      group_->comm->allreduce(l.data(), static_cast<int64_t>(l.size()));
  }
  skip_.clear();
  if (group_) {
    reduce_group(acc);
  } else if (opts_.sparse_push) {
    const int64_t per = cfg_.model.expert_hidden * cfg_.model.dim;
    for (const MoeBlockRef& block : model_->moe_blocks()) {
      const std::size_t m = static_cast<std::size_t>(model_->moe_index(block.layer));
      const std::vector<int64_t>& load = acc.tokens_per_expert[m];
      for (int64_t e = 0; e < E; ++e)
        if (load[static_cast<std::size_t>(e)] == 0)
          for (int64_t base : {block.offsets.w1, block.offsets.w3, block.offsets.w2})
            skip_.push_back({base + e * per, per});
    }
    std::sort(skip_.begin(), skip_.end(),
              [](const Span& x, const Span& y) { return x.offset < y.offset; });
  }
  return {R, a.global_rows, acc.loss.total};
}

PushMeta WorkerStep::local_round(int64_t clock, const RowAssignment& a) {
  const int64_t H = opts_.local_steps, A = cfg_.train.grad_accum, n = model_->layout().size();
  if (!opt_) {
    opt_ = make_optimizer(cfg_.optim.optimizer_config(), param_groups(model_->layout()), 0, n);
    schedule_ = std::make_unique<LrSchedule>(cfg_.optim.schedule_config(cfg_.train.steps * H));
    comm_ = make_local_comm();
  }
  // A group's local step is one step of the group: the mean over the group's rows, the dense
  // gradients summed over its ranks, the check and clip over its parts, as `train` steps with
  // dist.ep = P over the same processes.
  int64_t rows = a.rows;
  if (group_) group_->comm->allreduce(&rows, 1);
  double loss = 0;
  for (int64_t h = 0; h < H; ++h) {
    const int64_t step = clock * H + h;
    // The mean over this worker's (group's) rows: a local step is a whole step of its own.
    const Accumulated acc = accumulate_rows(
        step, a,
        static_cast<float>(static_cast<double>(a.rows) / static_cast<double>(rows * A)));
    loss += acc.loss.total;
    UpdateOptions o;
    o.grad_clip = cfg_.optim.grad_clip;
    o.where = fmt::format("local step {} on worker {}", step, index_);
    o.advice = "Lower optim.lr or raise optim.warmup_steps";
    bool skipped = false;
    if (group_) {
      // Rank q's dense chunk: Σ over the ranks in rank order (the group's reduce-scatter);
      // checked and clipped with the rank's experts, then gathered so that every rank steps the
      // same dense values, each its own experts.
      pack(dense_keys_, grads_.data(), dense_.data());
      group_->comm->reduce_scatter(chunk_.data(), dense_.data(), chunk_counts_);
      unpack(chunk_keys_, chunk_.data(), grads_.data());
      SpansGradient g(grads_.data(), keys_);
      skipped = check_and_clip(g, *group_->comm, o).skipped;
      pack(chunk_keys_, grads_.data(), chunk_.data());
      group_->comm->allgather(dense_.data(), chunk_.data(), chunk_counts_);
      unpack(dense_keys_, dense_.data(), grads_.data());
    } else {
      FlatGradient g(grads_.data(), n);
      skipped = check_and_clip(g, *comm_, o).skipped;
    }
    if (!skipped) opt_->step(params_.data(), grads_.data(), static_cast<float>(schedule_->lr(step)));
  }
  // grads = params × the worker's (group's) share of the global batch, which the servers sum
  // into the row-weighted mean; a group's rank pushes its keys alone, and the push's rows are its
  // own, so that the rows of a clock's pushes add up to the global batch.
  const auto share =
      static_cast<float>(static_cast<double>(rows) / static_cast<double>(a.global_rows));
  float* g = grads_.data();
  const float* p = params_.data();
  for (int64_t i = 0; i < n; ++i) g[i] = p[i] * share;
  skip_ = group_ ? complement(keys_, static_cast<int64_t>(grads_.size()))
                 : std::vector<Span>{};  // a worker alone pushes every parameter
  return {a.rows, a.global_rows, loss / static_cast<double>(H)};
}

void WorkerStep::finish(int64_t clock) {
  const ParamLayout& layout = model_->layout();
  CheckpointContents c;
  for (const auto& p : layout.params())
    c.model.push_back({p.name, p.shape, params_.data() + p.offset});
  // The router biases the servers hold, in the training state as the trainers write them.
  set_router_biases();
  c.state = bias_views(*model_);
  c.config = lm_checkpoint_config(cfg_);
  c.files = tokenizer_.hf_files(cfg_.model.max_seq_len);
  c.trainer = {{"step", clock},
               {"tokenizer", tokenizer_.fingerprint()},
               {"config_hash", cfg_.config_hash()},
               {"seed", cfg_.train.seed},
               {"parameter_server", opts_.to_json()}};
  fs::path dir = write_checkpoint(cfg_.train.run_dir, clock, c, cfg_.train.keep_checkpoints);
  TokenShard val(fs::path(cfg_.data.dir) / "val.bin");
  // A group's rank holds part of the experts and exchanges tokens with its group, which does not
  // validate with it: the lead validates alone, with every expert, on the values it pulled.
  std::unique_ptr<Transformer> whole;
  if (group_) {
    whole = std::make_unique<Transformer>(cfg_.model);
    whole->set_precision(cfg_.train.precision_dtype());
  }
  model_->weights_changed();  // the final pull wrote the parameters in place
  const double v = evaluate(whole ? *whole : *model_, params_.data(), val, cfg_.train.batch_size,
                            cfg_.train.seq_len, cfg_.train.eval_batches);
  MetricsWriter(cfg_.train.run_dir, MetricsWriter::Open::Append, cfg_.train.tensorboard)
      .write({{"step", clock}, {"val_loss", v}});
  log_info("ps worker {}: final checkpoint {} (clock {}); validation loss {:.4f}", index_,
           dir.string(), clock, v);
}

}  // namespace moetrain::ps
