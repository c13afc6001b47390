#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/page_buffer.h"
#include "kernels/softmax.h"
#include "model/device_ops.h"
#include "model/transformer_acts.h"

namespace moetrain {

Transformer::Transformer(const ModelConfig& cfg, const MoeContext& ctx)
    : cfg_(cfg),
      layout_(cfg),
      cpu_(std::make_unique<CpuOps>(static_cast<float>(cfg.rope_theta))),
      ops_(cpu_.get()),
      end_(cfg.n_layers) {
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    if (cfg_.is_dense_layer(l)) {
      moe_index_.push_back(-1);
    } else {
      moe_index_.push_back(static_cast<int64_t>(moe_.size()));
      moe_.push_back(std::make_unique<MoeLayer>(cfg_.moe(), ctx));
    }
    acts_.push_back(std::make_unique<LayerActs>());
  }
}

Transformer::~Transformer() = default;

void Transformer::set_device(const std::string& device) {
  MOETRAIN_CHECK(device == "cpu" || device == "cuda", "device '{}': allowed are cpu, cuda", device);
  if (device == "cpu") return switch_ops(cpu_.get());
  check_device_runs_it(device);
  // One CUDA device's operations for the model's life (kept while the model runs on the CPU in
  // between): its buffers live in their memory.
  if (!device_is_cuda_) set_device(make_cuda_ops(*this));
  device_is_cuda_ = true;
  switch_ops(device_.get());
}

void Transformer::check_device_runs_it(const std::string& device) const {
  MOETRAIN_CHECK(first_ == 0 && end_ == cfg_.n_layers,
                 "device '{}': a device runs the whole model, not a pipeline stage", device);
  MOETRAIN_CHECK(recompute_ == Recompute::None,
                 "device '{}' with train.recompute = {}: a device keeps every activation "
                 "(none only)",
                 device, recompute_name(recompute_));
  MOETRAIN_CHECK(!tp_, "device '{}': tensor parallelism (dist.tp) runs on the CPU", device);
  MOETRAIN_CHECK(!split_, "device '{}': split backward (zero_bubble) runs on the CPU", device);
  MOETRAIN_CHECK(!units_, "device '{}': sharded parameters (dist.zero = 3) run on the CPU", device);
}

void Transformer::set_device(std::unique_ptr<DeviceOps> ops) {
  MOETRAIN_CHECK(ops, "set_device: no operations");
  check_device_runs_it(ops->describe());
  release_buffers();  // out of the memory of the operations replaced
  device_ = std::move(ops);
  device_is_cuda_ = false;
  switch_ops(device_.get());
}

void Transformer::switch_ops(ModelOps* ops) {
  if (ops == ops_) return;
  release_buffers();  // the next forward allocates them in the new memory
  ops_ = ops;
}

void Transformer::release_buffers() {
  for (auto& a : acts_) a = std::make_unique<LayerActs>();
  for (Floats* f : {&resid_, &lnf_, &rstdf_, &logits_, &lse_, &losses_, &dlogits_, &dresid_,
                    &dxmid_, &dln_, &dq_, &dk_, &dv_, &datt_, &dh1_, &dh3_, &dg_})
    f->reset();
  for (Ints* i : {&inputs_dev_, &targets_dev_, &pos_dev_}) i->reset();
  capacity_ = 0;
  have_targets_ = false;
}

const float* Transformer::logits() {
  const int64_t N = B_ * T_;
  return ops_->to_host(logits_host_, logits_.data(), N * tp_shard(N).V);
}

void Transformer::weights_changed() {
  lp_stale_ = true;
  if (device_) device_->weights_changed();
}

LowPrecisionCopy Transformer::lp_copy_of(const float* params) {
  if (cpu_->precision() == DType::F32 || lp_stale_ || params != lp_source_) return {};
  return {cpu_->precision(), cpu_->weight_copy().data()};
}

void Transformer::weights_changed_copy_kept() {
  if (device_) device_->weights_changed();
}

void Transformer::set_precision(DType t) {
  cpu_->set_precision(t);
  lp_stale_ = true;
}

std::vector<MoeLayer*> Transformer::moe_layers() {
  std::vector<MoeLayer*> out;
  for (auto& m : moe_) out.push_back(m.get());
  return out;
}

std::vector<MoeBlockRef> Transformer::moe_blocks() {
  std::vector<MoeBlockRef> out;
  for (int64_t l = 0; l < cfg_.n_layers; ++l)
    if (const int64_t m = moe_index_[l]; m >= 0)
      out.push_back({l, layout_.layers[l], moe_[m].get()});
  return out;
}

void Transformer::set_stage(int64_t first, int64_t end) {
  MOETRAIN_CHECK(0 <= first && first < end && end <= cfg_.n_layers,
                 "pipeline stage of blocks [{}, {}): needs 0 ≤ first < end ≤ model.n_layers = {}",
                 first, end, cfg_.n_layers);
  MOETRAIN_CHECK(!on_device() || (first == 0 && end == cfg_.n_layers),
                 "a pipeline stage runs on the CPU: a device runs the whole model");
  if (first == first_ && end == end_) return;
  first_ = first, end_ = end;
  release_buffers();
}

float* Transformer::resid_at(int64_t l) {
  return resid_.data() + (l - first_) * stream_rows() * cfg_.dim;
}

const float* Transformer::stage_output() const {
  return resid_.data() + (end_ - first_) * stream_rows() * cfg_.dim;
}

void Transformer::ensure_capacity(int64_t N) {
  if (N <= capacity_) return;
  // Under tensor parallelism this rank's heads, hidden units and vocabulary columns.
  const TpShard sh = tp_shard(N);
  const int64_t C = cfg_.dim, V = sh.V, QD = sh.QD, KD = sh.KD;
  // The residual stream's rows (sequence parallelism: this rank's tokens); the norms' outputs
  // entering the attention (and a dense FFN) are gathered whole.
  const int64_t R = sp_ ? (N + tp_->size() - 1) / tp_->size() : N;
  auto sz = [](int64_t n) { return static_cast<std::size_t>(n); };
  ModelOps& m = *ops_;
  bool any_dense = false;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) any_dense |= cfg_.is_dense_layer(l);
  // full: one set of block activations (acts_[0], block_acts) that every block's forward (and
  // recompute) writes, in a pipeline stage too. Otherwise the stage's own blocks' sets only.
  const bool one_set = recompute_ == Recompute::Full;
  for (int64_t l = one_set ? 0 : first_; l < (one_set ? 1 : end_); ++l) {
    LayerActs& a = *acts_[l];
    a.ln1.resize(m, N * C), a.rstd1.resize(m, R);
    a.q.resize(m, N * QD), a.k.resize(m, N * KD), a.v.resize(m, N * KD);
    a.att.resize(m, N * QD), a.lse.resize(m, N * sh.NH);
    const bool dense = recompute_ == Recompute::Full ? any_dense : cfg_.is_dense_layer(l);
    a.xmid.resize(m, R * C), a.ln2.resize(m, (dense ? N : R) * C), a.rstd2.resize(m, R),
        a.ffn.resize(m, R * C);
    if (recompute_ == Recompute::Full ? any_dense : cfg_.is_dense_layer(l)) {
      a.h1.resize(m, N * sh.Fd), a.h3.resize(m, N * sh.Fd), a.g.resize(m, N * sh.Fd);
    }
  }
  const int64_t Fd = any_dense ? sh.Fd : 0;
  if (tp_) {
    tp_rows_.resize(sz((N + tp_->size() - 1) / tp_->size() * C));
    xent_max_.resize(sz(N)), xent_sums_.resize(sz(2 * N));
    if (sp_) tp_full_.resize(sz(N * C));
  }
  inputs_.resize(sz(N)), targets_.resize(sz(N)), pos_.resize(sz(N));
  resid_.resize(m, (end_ - first_ + 1) * R * C);
  if (last_stage()) {
    lnf_.resize(m, N * C), rstdf_.resize(m, R);
    logits_.resize(m, N * V), lse_.resize(m, N), losses_.resize(m, N);
    dlogits_.resize(m, N * V);
  }
  dresid_.resize(m, N * C), dxmid_.resize(m, N * C), dln_.resize(m, N * C);
  dq_.resize(m, N * QD), dk_.resize(m, N * KD), dv_.resize(m, N * KD), datt_.resize(m, N * QD);
  dh1_.resize(m, N * Fd), dh3_.resize(m, N * Fd), dg_.resize(m, N * Fd);
  capacity_ = N;
}

std::pair<int64_t, int64_t> Transformer::unit_range(int64_t unit) const {
  const int64_t L = cfg_.n_layers;
  const int64_t lo = unit == 0 ? 0 : unit <= L ? layout_.layers[unit - 1].ln1 : layout_.final_norm;
  const int64_t hi = unit < L ? layout_.layers[unit].ln1 : unit == L ? layout_.final_norm
                                                                      : layout_.size();
  return {lo, hi};
}

void Transformer::acquire(int64_t unit, int64_t next, const float* params) {
  if (!units_) return;
  units_->acquire(unit, next);
  const DType lp = cpu_->precision();
  if (lp == DType::F32) return;
  // The unit's low-precision copy, made from what was gathered.
  const auto [lo, hi] = unit_range(unit);
  f32_to_dtype(lp, static_cast<char*>(cpu_->weight_copy().ensure(layout_.size())) + lo * 2,
               params + lo, static_cast<std::size_t>(hi - lo));
}

void Transformer::release(int64_t unit) {
  if (!units_) return;
  units_->release(unit);
  HalfBuffer& copy = cpu_->weight_copy();
  if (cpu_->precision() == DType::F32 || !copy.data()) return;
  const auto [lo, hi] = unit_range(unit);
  release_whole_pages(static_cast<char*>(copy.data()) + lo * 2, (hi - lo) * 2);
}

void Transformer::refresh_lp_weights(const float* params) {
  // Sharded parameters: each unit's copy is made where it is gathered (acquire). A device keeps
  // its own (DeviceOps::set_gemm).
  const DType lp = cpu_->precision();
  if (lp == DType::F32 || units_ || on_device() || (!lp_stale_ && params == lp_source_)) return;
  // A pipeline stage: its own units' weights.
  const int64_t lo = unit_range(first_ == 0 ? 0 : 1 + first_).first;
  const int64_t hi = unit_range(last_stage() ? cfg_.n_layers + 1 : end_).second;
  f32_to_dtype(lp, static_cast<char*>(cpu_->weight_copy().ensure(layout_.size())) + lo * 2,
               params + lo, static_cast<std::size_t>(hi - lo));
  lp_source_ = params;
  lp_stale_ = false;
}

LossParts Transformer::forward(const float* params, const int32_t* inputs, const int32_t* targets,
                               int64_t B, int64_t T, const MoeStep& step) {
  return forward(params, inputs, nullptr, targets, B, T, step);
}

LossParts Transformer::forward(const float* params, const int32_t* inputs, const float* x,
                               const int32_t* targets, int64_t B, int64_t T, const MoeStep& step) {
  MOETRAIN_CHECK(B > 0 && T > 0, "forward: batch {} and sequence {} must be positive", B, T);
  MOETRAIN_CHECK(T <= cfg_.max_seq_len,
                 "forward: sequence length {} exceeds model.max_seq_len = {}", T, cfg_.max_seq_len);
  MOETRAIN_CHECK((first_ == 0) == (x == nullptr),
                 "forward: the stage beginning at block {} {} the previous stage's output", first_,
                 first_ == 0 ? "embeds its tokens, not" : "takes");
  MOETRAIN_CHECK(n_deferred_ == 0,
                 "forward: the last backward's weight gradients are still deferred (split "
                 "backward): weight_backward reads this model's activations first");
  const int64_t N = B * T, C = cfg_.dim;
  const float eps = static_cast<float>(cfg_.norm_eps);
  ensure_capacity(N);
  const TpShard sh = tp_shard(N);
  const int64_t V = sh.V;  // under tensor parallelism this rank's vocabulary columns
  const bool last = last_stage();
  B_ = B, T_ = T, have_targets_ = last ? targets != nullptr : step.training;
  if (first_ == 0) {
    // A device's embedding cannot check its ids: they are checked here first.
    if (on_device())
      for (int64_t i = 0; i < N; ++i)
        MOETRAIN_CHECK(inputs[i] >= 0 && inputs[i] < cfg_.vocab_size,
                       "forward: token {} at position {} is not in [0, vocab_size = {})", inputs[i],
                       i, cfg_.vocab_size);
    std::memcpy(inputs_.data(), inputs, sizeof(int32_t) * N);
    inputs_at_ = ops_->ids(inputs_dev_, inputs_.data(), N);
  }
  if (targets && last) {
    std::memcpy(targets_.data(), targets, sizeof(int32_t) * N);
    targets_at_ = ops_->ids(targets_dev_, targets_.data(), N);
  }
  for (int64_t i = 0; i < N; ++i) pos_[i] = static_cast<int32_t>(i % T);
  pos_at_ = ops_->ids(pos_dev_, pos_.data(), N);
  refresh_lp_weights(params);
  ops_->bind_params(params);
  const float* P = ops_->params();
  const int64_t L = cfg_.n_layers, head = L + 1;
  if (first_ == 0) {
    acquire(0, 1, params);
    // Sequence parallelism: this rank's tokens only.
    ops_->embedding_forward(resid_at(0), inputs_at_ + (sp_ ? sh.n0 : 0), P + layout_.embed,
                            stream_rows(), C, cfg_.vocab_size);
    release(0);
  } else {
    std::memcpy(resid_at(first_), x, sizeof(float) * static_cast<std::size_t>(stage_rows(N) * C));
  }
  LossParts parts;
  for (int64_t l = first_; l < end_; ++l) {
    acquire(1 + l, last || l + 1 < end_ ? 2 + l : -1, params);
    block_forward(l, step, false, &parts);
    release(1 + l);
  }
  const int64_t n_moe = cfg_.n_moe_layers();
  if (!last) {
    if (n_moe > 0) parts.aux /= n_moe, parts.z /= n_moe;
    parts.total = cfg_.aux_loss_coef * parts.aux + cfg_.z_loss_coef * parts.z;
    return parts;
  }
  acquire(head, -1, params);
  // Sequence parallelism: the norm of this rank's rows, gathered for the head.
  ops_->rmsnorm_forward(sp_ ? tp_rows_.data() : lnf_.data(), rstdf_.data(), resid_at(L),
                        P + layout_.final_norm, stream_rows(), C, eps);
  if (sp_) tp_allgather_rows(lnf_.data(), tp_rows_.data(), stream_rows(), C);
  const void* lnf = ops_->round(lnf_lp_, lnf_.data(), N * C);
  ops_->linear_forward(logits_.data(), lnf_.data(), lnf, layout_.lm_head + sh.v0 * C, N, C, V);
  // A training forward's backward starts at the head: it stays in place until then.
  if (!targets || !step.training) release(head);
  if (n_moe > 0) parts.aux /= n_moe, parts.z /= n_moe;
  if (!targets) return parts;

  if (tp_) {
    // The vocabulary is split: the rows' maxima, then their exponentials' sums and target logits,
    // each combined over the group.
    xent_shard_max(xent_max_.data(), logits_.data(), N, V);
    tp_->allreduce(xent_max_.data(), N, {.op = ReduceOp::Max});
    xent_shard_sums(xent_sums_.data(), logits_.data(), xent_max_.data(), targets_.data(), sh.v0,
                    N, V, cfg_.vocab_size);
    tp_->allreduce(xent_sums_.data(), 2 * N);
    xent_shard_finish(losses_.data(), lse_.data(), xent_max_.data(), xent_sums_.data(),
                      targets_.data(), N);
  } else {
    ops_->softmax_xent_forward(losses_.data(), lse_.data(), logits_.data(), targets_at_, N, V);
  }
  // In token order, in double, on the host.
  const float* losses = ops_->to_host(losses_host_, losses_.data(), N);
  double sum = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (targets_[i] >= 0) sum += losses[i], ++parts.targets;
  }
  parts.ce = parts.targets ? sum / parts.targets : 0.0;
  parts.total = parts.ce + cfg_.aux_loss_coef * parts.aux + cfg_.z_loss_coef * parts.z;
  return parts;
}

KvCache Transformer::make_kv_cache(int64_t capacity) const {
  MOETRAIN_CHECK(capacity > 0 && capacity <= cfg_.max_seq_len,
                 "KV cache of {} positions: must be in [1, model.max_seq_len = {}]", capacity,
                 cfg_.max_seq_len);
  KvCache c;
  c.capacity = capacity;
  const auto n = static_cast<std::size_t>(capacity * cfg_.n_kv_heads * cfg_.head_dim());
  c.k.assign(static_cast<std::size_t>(cfg_.n_layers), std::vector<float>(n));
  c.v = c.k;
  return c;
}

const float* Transformer::prefill(const float* params, const int32_t* tokens, int64_t n,
                                  KvCache& cache) {
  MOETRAIN_CHECK(n > 0 && n <= cache.capacity,
                 "prefill: {} tokens for a KV cache of {} positions", n, cache.capacity);
  MOETRAIN_CHECK(static_cast<int64_t>(cache.k.size()) == cfg_.n_layers,
                 "prefill: the KV cache has {} layers, the model {}", cache.k.size(),
                 cfg_.n_layers);
  MOETRAIN_CHECK(!on_device(), "prefill: decoding runs on the CPU (set_device(\"cpu\") first)");
  MOETRAIN_CHECK(first_ == 0 && last_stage(), "prefill: decoding runs the whole model, not a "
                                              "pipeline stage");
  MOETRAIN_CHECK(!tp_, "prefill: decoding runs on one process, not under tensor parallelism");
  MoeStep step;
  step.training = false;
  fill_cache_ = &cache;  // each block copies its keys and values in
  try {
    forward(params, tokens, nullptr, 1, n, step);
  } catch (...) {
    fill_cache_ = nullptr;
    throw;
  }
  fill_cache_ = nullptr;
  cache.length = n;
  return logits_.data() + (n - 1) * cfg_.vocab_size;
}

void Transformer::backward(const float* params, float* grads, float loss_weight) {
  backward(params, grads, loss_weight, nullptr);
}

void Transformer::backward(const float* params, float* grads, float loss_weight,
                           const float* dout) {
  MOETRAIN_CHECK(have_targets_, "backward needs a forward with targets first");
  MOETRAIN_CHECK(n_deferred_ == 0,
                 "backward: the last backward's weight gradients are still deferred (split "
                 "backward): run weight_backward first");
  const bool last = last_stage();
  MOETRAIN_CHECK(last == (dout == nullptr),
                 "backward: the stage ending at block {} {} the gradient of its output", end_,
                 last ? "starts from its loss, not" : "takes");
  const int64_t N = B_ * T_, C = cfg_.dim, V = cfg_.vocab_size;
  ops_->begin_grads(params, grads);
  float* G = ops_->grads();
  // The balancing losses are means over MoE layers: each layer's share of their gradient (under
  // tensor parallelism, over tp times the processes whose tokens the layers see).
  const int64_t n_moe = cfg_.n_moe_layers();
  const float moe_weight =
      n_moe > 0 ? loss_weight / static_cast<float>(n_moe * tensor_parallel()) : 0.f;
  if (!last) {
    std::memcpy(dresid_.data(), dout, sizeof(float) * static_cast<std::size_t>(stage_rows(N) * C));
    grads_ready(layout_.layers[end_].ln1);  // later stages' gradients
  } else {
    head_backward(params, loss_weight);
  }
  for (int64_t l = end_ - 1; l >= first_; --l) {
    acquire(1 + l, l > first_ ? l : -1, params);  // the embedding's backward reads no weight
    // full: the block's activations again, from its input, right before its backward.
    if (recompute_ == Recompute::Full) block_forward(l, MoeStep{}, true, nullptr);
    block_backward(l, moe_weight);
    release(1 + l);
    grads_ready(layout_.layers[l].ln1);  // the block's first tensor
  }
  // Under tensor parallelism every rank holds the same dresid_: rank 0 writes the table's gradient
  // (sequence parallelism: each rank its tokens').
  if (first_ == 0 && (!tp_ || sp_ || tp_->rank() == 0))
    ops_->embedding_backward(G + layout_.embed, dresid_.data(),
                             inputs_at_ + (sp_ ? tp_shard(N).n0 : 0), stream_rows(), C, V);
  ops_->end_grads(grads);
  grads_ready(0);  // an earlier stage's gradients stay as they are
}

// The loss's gradient through the head and the final norm into dresid_.
void Transformer::head_backward(const float* params, float loss_weight) {
  const int64_t N = B_ * T_, C = cfg_.dim;
  const TpShard sh = tp_shard(N);
  const int64_t V = sh.V;
  const float* P = ops_->params();
  float* G = ops_->grads();
  int64_t counted = 0;
  for (int64_t i = 0; i < N; ++i) counted += targets_[i] >= 0;
  // d(mean CE)/d loss_i = 1 / counted; positions with target −1 get no gradient.
  const float dloss = counted ? loss_weight / static_cast<float>(counted) : 0.f;
  if (tp_) {
    const std::vector<float> dlosses(static_cast<std::size_t>(N), dloss);
    softmax_xent_shard_backward(dlogits_.data(), dlosses.data(), logits_.data(), lse_.data(),
                                targets_.data(), sh.v0, N, V, cfg_.vocab_size);
  } else {
    ops_->softmax_xent_backward(dlogits_.data(), dloss, logits_.data(), lse_.data(), targets_at_, N,
                                V);
  }
  const int64_t L = cfg_.n_layers, head = L + 1;
  acquire(head, L, params);
  linear_bwd(tp_partial(dln_.data()), false, G + layout_.lm_head + sh.v0 * C, dlogits_.data(),
             lnf_.data(), lnf_lp_.data(), layout_.lm_head + sh.v0 * C, N, C, V);
  tp_sum(dln_.data(), C);  // every rank's vocabulary columns
  ops_->rmsnorm_backward(dresid_.data(), tp_owned(G, layout_.final_norm, C), dln_.data(),
                         resid_at(L), P + layout_.final_norm, rstdf_.data(), stream_rows(), C);
  release(head);
  grads_ready(layout_.final_norm);
}

std::vector<int64_t> Transformer::unit_starts() const {
  std::vector<int64_t> starts;
  for (int64_t u = 0; u <= cfg_.n_layers + 1; ++u) starts.push_back(unit_range(u).first);
  return starts;
}

double Transformer::flops_per_token(int64_t T) const {
  // Active parameters per token: everything but the unused experts and the embedding table
  // (a lookup, not a matmul).
  const int64_t C = cfg_.dim, HS = cfg_.head_dim();
  double active = 0;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    active += double(C) * HS * (2 * cfg_.n_heads + 2 * cfg_.n_kv_heads);
    if (cfg_.is_dense_layer(l)) {
      active += 3.0 * C * cfg_.dense_ffn_hidden();
    } else {
      active += double(C) * cfg_.n_experts + 3.0 * C * cfg_.expert_hidden * cfg_.top_k;
      active += 3.0 * C * cfg_.shared_expert_hidden;
    }
  }
  active += double(C) * cfg_.vocab_size;
  // Causal attention: QKᵀ and PV each 2·T/2·HS per head per token forward, ×3 with backward.
  double attn = cfg_.n_layers * 3.0 * 2.0 * 2.0 * (T / 2.0) * HS * cfg_.n_heads;
  return 6.0 * active + attn;
}

}  // namespace moetrain
