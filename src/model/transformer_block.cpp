// One block's forward and backward, and what the blocks keep for backward (activation
// recomputation, moe/recompute.h): Transformer::forward runs block_forward for every block;
// under recompute = full, Transformer::backward runs it again (replay) on the block's kept input
// right before block_backward, last block first.
#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "model/activation_bytes.h"
#include "model/transformer.h"
#include "model/transformer_acts.h"

namespace moetrain {

Transformer::LayerActs& Transformer::acts_at(int64_t l) {
  return *acts_[recompute_ == Recompute::Full ? 0 : l];
}

void Transformer::set_recompute(Recompute r) {
  MOETRAIN_CHECK(!on_device() || r == Recompute::None,
                 "train.recompute = {}: a device keeps every activation (none only)",
                 recompute_name(r));
  MOETRAIN_CHECK(!split_ || r != Recompute::Full,
                 "train.recompute = full with split backward (zero_bubble): the deferred weight "
                 "gradients read each block's activations, which full keeps one set of");
  if (r == recompute_) return;
  recompute_ = r;
  release_buffers();  // sized for the mode at the next forward
  scratch_ = r == Recompute::None ? nullptr : std::make_unique<RecomputeScratch>();
  for (auto& m : moe_) m->set_recompute(r, scratch_.get());
}

// dinp (N, IC) = (or += with acc) dout (N, OC) · W (may be null); dweight (OC, IC) += doutᵀ · inp,
// or under split backward later (weight_backward), from a copy of dout. inp_lp: the forward's
// rounded inp (mixed precision).
void Transformer::linear_bwd(float* dinp, bool acc, float* dweight, const float* dout,
                             const float* inp, const void* inp_lp, int64_t w, int64_t N, int64_t IC,
                             int64_t OC, int64_t ld) {
  DeferredGemm* later = nullptr;
  if (split_) {
    later = &defer();
    later->w = w, later->N = N, later->IC = IC, later->OC = OC, later->ld = ld;
    later->inp = inp, later->inp_lp = inp_lp;
    // f32 keeps dout; mixed precision its rounded copy (round, below).
    if (cpu_->precision() == DType::F32) later->dout.assign(dout, dout + N * OC);
  }
  const void* d = ops_->round(later ? later->dout_lp : dout_lp_, dout, N * OC);
  if (dinp) ops_->linear_backward_input(dinp, acc, dout, d, w, N, IC, OC, ld);
  if (!later) ops_->linear_backward_weight(dweight, dout, d, inp, inp_lp, N, IC, OC, ld);
}

void Transformer::set_tensor_parallel(Comm* group, bool sequence_parallel) {
  MOETRAIN_CHECK(!group || group->size() == 1 || !on_device(),
                 "tensor parallelism (dist.tp): CPU only, not on a device");
  const int64_t tp = group ? group->size() : 1;
  if (tp > 1) {
    auto divides = [&](int64_t n, const char* key) {
      MOETRAIN_CHECK(n % tp == 0, "dist.tp = {} does not divide {} = {}: each tensor-parallel "
                     "rank takes an equal share", tp, key, n);
    };
    divides(cfg_.n_heads, "model.n_heads");
    divides(cfg_.n_kv_heads, "model.n_kv_heads");
    divides(cfg_.vocab_size, "model.vocab_size");
    for (int64_t l = 0; l < cfg_.n_layers; ++l)
      if (cfg_.is_dense_layer(l)) divides(cfg_.dense_ffn_hidden(), "the dense FFN's hidden size");
  }
  tp_ = tp > 1 ? group : nullptr;
  sp_ = tp_ && sequence_parallel;
  capacity_ = 0;  // the buffers are sized per rank
  have_targets_ = false;
}

Transformer::TpShard Transformer::tp_shard(int64_t N) const {
  const int64_t tp = tensor_parallel(), t = tp_ ? tp_->rank() : 0, HS = cfg_.head_dim();
  TpShard s;
  s.NH = cfg_.n_heads / tp, s.NKV = cfg_.n_kv_heads / tp;
  s.QD = s.NH * HS, s.KD = s.NKV * HS, s.q0 = t * s.QD, s.k0 = t * s.KD;
  s.Fd = cfg_.dense_ffn_hidden() / tp, s.f0 = t * s.Fd;
  s.V = cfg_.vocab_size / tp, s.v0 = t * s.V;
  s.n0 = chunk_begin(N, static_cast<int>(t), static_cast<int>(tp));
  s.Nl = chunk_begin(N, static_cast<int>(t) + 1, static_cast<int>(tp)) - s.n0;
  return s;
}

void Transformer::tp_allreduce(float* x, int64_t n) {
  if (tp_) tp_->allreduce(x, n);
}

// Each rank's rows of the batch's N, times C: the counts of the row collectives.
std::vector<int64_t> Transformer::tp_row_counts(int64_t C) const {
  const int P = tp_->size();
  const int64_t N = B_ * T_;
  std::vector<int64_t> counts(static_cast<std::size_t>(P));
  for (int q = 0; q < P; ++q) counts[q] = (chunk_begin(N, q + 1, P) - chunk_begin(N, q, P)) * C;
  return counts;
}

void Transformer::tp_allgather_rows(float* out, const float* mine, int64_t Nl, int64_t C) {
  const std::vector<int64_t> counts = tp_row_counts(C);
  MOETRAIN_CHECK(counts[tp_->rank()] == Nl * C, "tensor-parallel rows: {} of {}", Nl, B_ * T_);
  tp_->allgather(out, mine, counts);
}

float* Transformer::tp_partial(float* out) {
  return sp_ ? tp_full_.data() : out;
}

void Transformer::tp_sum(float* out, int64_t C) {
  if (sp_) {
    tp_->reduce_scatter(out, tp_full_.data(), tp_row_counts(C));
  } else {
    tp_allreduce(out, B_ * T_ * C);
  }
}

int64_t Transformer::stage_rows(int64_t N) const { return sp_ ? tp_shard(N).Nl : N; }

int64_t Transformer::stream_rows() const { return stage_rows(B_ * T_); }

float* Transformer::tp_owned(float* grads, int64_t offset, int64_t n) {
  if (!tp_ || sp_ || tp_->rank() == 0) return grads + offset;
  tp_scratch_.assign(static_cast<std::size_t>(n), 0.0f);
  return tp_scratch_.data();
}

void Transformer::set_split_backward(bool on) {
  MOETRAIN_CHECK(!on || !on_device(), "split backward (zero_bubble): CPU only, not under a device");
  MOETRAIN_CHECK(!on || recompute_ != Recompute::Full,
                 "split backward (zero_bubble) with train.recompute = full: the deferred weight "
                 "gradients read each block's activations, which full keeps one set of");
  MOETRAIN_CHECK(n_deferred_ == 0, "set_split_backward: weight gradients are still deferred");
  split_ = on;
}

void Transformer::grads_ready(int64_t from) {
  // A device's gradients reach the caller's buffer only at the end (end_grads): no hook on it.
  if (on_device()) return;
  if (split_) {
    defer().ready_from = from;
  } else if (grads_ready_) {
    grads_ready_(from);
  }
}

Transformer::DeferredGemm& Transformer::defer() {
  if (deferred_.size() == n_deferred_) deferred_.push_back(std::make_unique<DeferredGemm>());
  DeferredGemm& d = *deferred_[n_deferred_++];
  d.ready_from = -1;
  return d;
}

void Transformer::weight_backward(float* grads) {
  for (std::size_t i = 0; i < n_deferred_; ++i) {
    const DeferredGemm& d = *deferred_[i];
    if (d.ready_from >= 0) {
      if (grads_ready_) grads_ready_(d.ready_from);
    } else {
      ops_->linear_backward_weight(grads + d.w, d.dout.data(), d.dout_lp.data(), d.inp, d.inp_lp,
                                   d.N, d.IC, d.OC, d.ld);
    }
  }
  n_deferred_ = 0;
}

int64_t Transformer::deferred_bytes() const {
  int64_t n = 0;
  for (const auto& d : deferred_)
    n += static_cast<int64_t>(d->dout.capacity() * sizeof(float)) + d->dout_lp.bytes();
  return n;
}

void Transformer::block_forward(int64_t l, const MoeStep& step, bool replay, LossParts* parts) {
  const int64_t B = B_, T = T_, N = B * T, C = cfg_.dim, HS = cfg_.head_dim();
  const TpShard sh = tp_shard(N);  // the whole model without tensor parallelism
  const int64_t NH = sh.NH, NKV = sh.NKV, QD = sh.QD, KD = sh.KD;
  const int64_t QDw = cfg_.n_heads * HS;  // o's row: every head's output
  const float eps = static_cast<float>(cfg_.norm_eps);
  ModelOps& op = *ops_;
  const float* P = op.params();
  const LayerOffsets& o = layout_.layers[l];
  LayerActs& a = acts_at(l);
  const float* x = resid_at(l);
  float* x_out = resid_at(l + 1);
  // R: the stream's rows here (this rank's tokens under sequence parallelism, which gathers the
  // norm's rows of every rank for the attention, and reduce-scatters its output).
  const int64_t R = sp_ ? sh.Nl : N;
  op.rmsnorm_forward(sp_ ? tp_rows_.data() : a.ln1.data(), a.rstd1.data(), x, P + o.ln1, R, C, eps);
  if (sp_) tp_allgather_rows(a.ln1.data(), tp_rows_.data(), R, C);
  const void* ln1 = op.round(a.ln1_lp, a.ln1.data(), N * C);
  op.linear_forward(a.q.data(), a.ln1.data(), ln1, o.wq + sh.q0 * C, N, C, QD);
  op.linear_forward(a.k.data(), a.ln1.data(), ln1, o.wk + sh.k0 * C, N, C, KD);
  op.linear_forward(a.v.data(), a.ln1.data(), ln1, o.wv + sh.k0 * C, N, C, KD);
  op.rope_forward(a.q.data(), a.q.data(), pos_at_, N, NH, HS, T);
  op.rope_forward(a.k.data(), a.k.data(), pos_at_, N, NKV, HS, T);
  if (fill_cache_) {
    std::copy_n(a.k.data(), N * KD, fill_cache_->k[l].data());
    std::copy_n(a.v.data(), N * KD, fill_cache_->v[l].data());
  }
  op.attention_forward(a.att.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), B, T, NH,
                       NKV, HS);
  const void* att = op.round(a.att_lp, a.att.data(), N * QD);
  op.linear_forward(tp_partial(a.xmid.data()), a.att.data(), att, o.wo + sh.q0, N, QD, C,
                    tp_ ? QDw : 0);
  tp_sum(a.xmid.data(), C);  // every rank's heads
  const bool moe_block = moe_index_[l] >= 0;
  // A dense FFN under sequence parallelism reads every rank's rows: gathered into a.ln2.
  const bool gather2 = sp_ && !moe_block;
  // xmid = the attention's output + the block's input, then its norm.
  op.add_rmsnorm_forward(gather2 ? tp_rows_.data() : a.ln2.data(), a.rstd2.data(), a.xmid.data(), x,
                         P + o.ln2, R, C, eps);
  if (gather2) tp_allgather_rows(a.ln2.data(), tp_rows_.data(), R, C);
  if (moe_block) {
    MoeLayer& moe = *moe_[moe_index_[l]];
    // Under tensor parallelism this rank's tokens only, joined after (sequence parallelism: the
    // stream holds just those).
    const bool join = tp_ && !sp_;
    float* out = join ? tp_rows_.data() : a.ffn.data();
    const float* inp = a.ln2.data() + (sp_ ? 0 : sh.n0 * C);
    MoeStep s = step;
    s.layer = static_cast<uint64_t>(l);
    s.token_offset += static_cast<uint64_t>(sh.n0);
    op.moe_forward(moe, l, out, inp, sh.Nl, o, s, replay);
    if (!replay) {
      parts->aux += moe.aux_loss();
      parts->z += moe.z_loss();
    }
    if (join && !replay) tp_allgather_rows(a.ffn.data(), out, sh.Nl, C);
  } else {
    const int64_t Fd = sh.Fd, Fdw = cfg_.dense_ffn_hidden();
    const void* ln2 = op.round(a.ln2_lp, a.ln2.data(), N * C);
    op.linear_forward(a.h1.data(), a.ln2.data(), ln2, o.mlp_w1 + sh.f0 * C, N, C, Fd);
    op.linear_forward(a.h3.data(), a.ln2.data(), ln2, o.mlp_w3 + sh.f0 * C, N, C, Fd);
    op.swiglu_forward(a.g.data(), a.h1.data(), a.h3.data(), N * Fd);
    const void* g = op.round(a.g_lp, a.g.data(), N * Fd);
    op.linear_forward(tp_partial(a.ffn.data()), a.g.data(), g, o.mlp_w2 + sh.f0, N, Fd, C,
                      tp_ ? Fdw : 0);
    tp_sum(a.ffn.data(), C);  // every rank's hidden units
  }
  if (replay) return;  // the block's output is kept (the next block's input)
  op.add(x_out, a.xmid.data(), a.ffn.data(), R * C);
}

void Transformer::block_backward(int64_t l, float moe_weight) {
  const int64_t B = B_, T = T_, N = B * T, C = cfg_.dim, HS = cfg_.head_dim();
  const TpShard sh = tp_shard(N);
  const int64_t NH = sh.NH, NKV = sh.NKV, QD = sh.QD, KD = sh.KD;
  const int64_t QDw = cfg_.n_heads * HS;
  ModelOps& op = *ops_;
  const float* P = op.params();
  float* G = op.grads();
  const LayerOffsets& o = layout_.layers[l];
  LayerActs& a = acts_at(l);
  const float* x = resid_at(l);
  const int64_t R = sp_ ? sh.Nl : N;  // the stream's rows here
  // dresid_ holds ∂L/∂(block output); it flows unchanged into the FFN output and the residual.
  if (moe_index_[l] >= 0) {
    // Under tensor parallelism: this rank's tokens, their input gradients joined after (sequence
    // parallelism: the stream holds just those).
    const bool join = tp_ && !sp_;
    float* dinp = join ? tp_rows_.data() : dln_.data();
    op.moe_backward(*moe_[moe_index_[l]], l, dinp, dresid_.data() + (sp_ ? 0 : sh.n0 * C), o,
                    moe_weight);
    if (join) tp_allgather_rows(dln_.data(), dinp, sh.Nl, C);
  } else {
    const int64_t Fd = sh.Fd, Fdw = cfg_.dense_ffn_hidden();
    // Sequence parallelism: every rank's rows of the output's gradient.
    if (sp_) tp_allgather_rows(tp_full_.data(), dresid_.data(), R, C);
    const float* dffn = sp_ ? tp_full_.data() : dresid_.data();
    linear_bwd(dg_.data(), false, G + o.mlp_w2 + sh.f0, dffn, a.g.data(), a.g_lp.data(),
               o.mlp_w2 + sh.f0, N, Fd, C, tp_ ? Fdw : 0);
    op.swiglu_backward(dh1_.data(), dh3_.data(), dg_.data(), a.h1.data(), a.h3.data(), N * Fd);
    float* dpart = tp_partial(dln_.data());
    linear_bwd(dpart, false, G + o.mlp_w1 + sh.f0 * C, dh1_.data(), a.ln2.data(), a.ln2_lp.data(),
               o.mlp_w1 + sh.f0 * C, N, C, Fd);
    linear_bwd(dpart, true, G + o.mlp_w3 + sh.f0 * C, dh3_.data(), a.ln2.data(), a.ln2_lp.data(),
               o.mlp_w3 + sh.f0 * C, N, C, Fd);
    tp_sum(dln_.data(), C);  // every rank's hidden units
  }
  // ∂L/∂xmid: through the FFN's norm and through the residual.
  op.rmsnorm_backward(dxmid_.data(), tp_owned(G, o.ln2, C), dln_.data(), a.xmid.data(), P + o.ln2,
                      a.rstd2.data(), R, C, dresid_.data());

  if (sp_) tp_allgather_rows(tp_full_.data(), dxmid_.data(), R, C);
  linear_bwd(datt_.data(), false, G + o.wo + sh.q0, sp_ ? tp_full_.data() : dxmid_.data(),
             a.att.data(), a.att_lp.data(), o.wo + sh.q0, N, QD, C, tp_ ? QDw : 0);
  op.attention_backward(dq_.data(), dk_.data(), dv_.data(), datt_.data(), a.q.data(), a.k.data(),
                        a.v.data(), a.att.data(), a.lse.data(), B, T, NH, NKV, HS);
  op.rope_backward(dq_.data(), dq_.data(), pos_at_, N, NH, HS, T);
  op.rope_backward(dk_.data(), dk_.data(), pos_at_, N, NKV, HS, T);
  float* dpart = tp_partial(dln_.data());
  linear_bwd(dpart, false, G + o.wq + sh.q0 * C, dq_.data(), a.ln1.data(), a.ln1_lp.data(),
             o.wq + sh.q0 * C, N, C, QD);
  linear_bwd(dpart, true, G + o.wk + sh.k0 * C, dk_.data(), a.ln1.data(), a.ln1_lp.data(),
             o.wk + sh.k0 * C, N, C, KD);
  linear_bwd(dpart, true, G + o.wv + sh.k0 * C, dv_.data(), a.ln1.data(), a.ln1_lp.data(),
             o.wv + sh.k0 * C, N, C, KD);
  tp_sum(dln_.data(), C);  // every rank's heads
  // ∂L/∂(block input): through the attention's norm and through the residual.
  op.rmsnorm_backward(dresid_.data(), tp_owned(G, o.ln1, C), dln_.data(), x, P + o.ln1,
                      a.rstd1.data(), R, C, dxmid_.data());
}

int64_t Transformer::activation_bytes() const {
  auto vec = [](const auto& v) { return static_cast<int64_t>(v.capacity() * sizeof(v[0])); };
  int64_t n = 0;
  for (const auto& a : acts_) n += a->bytes();
  n += resid_.bytes() + lnf_.bytes() + rstdf_.bytes() + lnf_lp_.bytes() + logits_.bytes() +
       lse_.bytes() + losses_.bytes() + vec(inputs_) + vec(targets_) + vec(pos_);
  for (const auto& m : moe_) n += m->held_bytes();
  if (scratch_) n += scratch_->bytes();
  return n + deferred_bytes();
}

int64_t activation_bytes_for(const ModelConfig& cfg, int64_t B, int64_t T, Recompute r,
                             DType lp, int64_t ep) {
  return activation_parts(cfg, B, T, r, lp, ep).total();
}

ActivationBytes activation_parts(const ModelConfig& cfg, int64_t B, int64_t T, Recompute r,
                                 DType lp, int64_t ep, RecomputeModules drop) {
  const int64_t N = B * T, C = cfg.dim, V = cfg.vocab_size, L = cfg.n_layers;
  // Queries and keys of qk, values of v elements a head; multi-head latent attention (the
  // planner's) keeps keys and values per head, and its latents.
  const int64_t NH = cfg.n_heads, NKV = cfg.mla() ? NH : cfg.n_kv_heads;
  const int64_t qk = cfg.qk_head_dim(), v = cfg.value_head_dim();
  const int64_t latents = cfg.mla() ? cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim : 0;
  const int64_t QD = NH * v;  // the attention's output
  const int64_t f = 4, h = lp == DType::F32 ? 0 : 2;  // bytes of f32, of a rounded copy
  const int64_t Fd = cfg.dense_ffn_hidden(), E = cfg.n_experts, K = cfg.top_k;
  const int64_t F = cfg.expert_hidden, Fs = cfg.shared_expert_hidden;
  // A full recompute keeps only each block's input: the modules drop nothing more.
  if (r == Recompute::Full) drop = {};
  // One block's activations (Transformer::LayerActs), dense FFN or not: ln1, xmid, ln2 and the
  // FFN's output (4 C), q, k, v, the attention's output, lse and the two rstd; rounded ln1 and
  // attention output; a dense FFN's h1, h3, g and rounded ln2 and g. Selective layernorm drops
  // the two norms' outputs and their rounded copies, mla_up_proj the per-head q, k and v.
  auto block = [&](bool dense) {
    int64_t b = f * (N * (4 * C + NH * qk + NKV * qk + NKV * v + QD + latents + 2) + N * NH) +
                h * N * (C + QD);
    if (dense) b += f * 3 * N * Fd + h * N * (C + Fd);
    if (drop.layernorm) b -= f * 2 * N * C + h * N * (dense ? 2 * C : C);
    if (drop.mla_up_proj && cfg.mla()) b -= f * N * (NH * qk + NKV * qk + NKV * v);
    return b;
  };
  // One MoE layer: routing and router scores (kept in every mode), then the routed rows (sent
  // and received, out and back: N·K each way on average) and the experts' intermediates.
  const int64_t R = N * K;
  const int64_t routing = N * K * (4 + 4 + 4) + f * N * E * 2 + f * N;
  const int64_t rows = f * (ep > 1 ? 4 : 2) * R * C;  // one process: no received copies
  // a, b, g in f32; in mixed precision a, b and the rounded g and inputs.
  auto inter_of = [&](int64_t rows_in, int64_t hidden) {
    return h == 0 ? f * 3 * rows_in * hidden : (2 * f + h) * rows_in * hidden + h * rows_in * C;
  };
  const int64_t inter = inter_of(R, F) + (Fs > 0 ? inter_of(N, Fs) : 0);
  // What a block keeps of them: selective moe_act drops the routed experts' g (f32, or the
  // rounded copy in mixed precision).
  const int64_t inter_kept = inter - (drop.moe_act ? (h == 0 ? f : h) * R * F : 0);
  const int64_t noisy = cfg.router == RouterKind::NoisyTopK ? f * 2 * N * E : 0;
  // Each block's residual input; once the stream leaving the last, the final norm (and its rstd),
  // the logits, their lse and losses, the rounded final norm, the tokens (inputs, targets,
  // positions).
  ActivationBytes a;
  a.blocks = f * L * N * C;
  a.once = f * N * C + f * N * (C + 1 + V + 1 + 1) + h * N * C + 12 * N;
  bool any_dense = false;
  for (int64_t l = 0; l < L; ++l) {
    const bool dense = cfg.is_dense_layer(l);
    any_dense |= dense;
    if (r != Recompute::Full) a.blocks += block(dense);
    if (dense) continue;
    a.blocks += routing + noisy;
    if (r != Recompute::Full) a.blocks += rows;
    if (r == Recompute::None) a.blocks += inter_kept;
  }
  if (r == Recompute::Full && L > 0) a.once += block(any_dense);
  // The MoE layers' shared working buffers: one layer's intermediates (moe, full) and rows (full).
  if (r != Recompute::None && cfg.n_moe_layers() > 0)
    a.once += inter + (r == Recompute::Full ? rows : 0);
  return a;
}

ActivationBytes deferred_grad_parts(const ModelConfig& cfg, int64_t B, int64_t T, DType lp) {
  const int64_t N = B * T, C = cfg.dim, e = lp == DType::F32 ? 4 : 2;
  const int64_t NH = cfg.n_heads, NKV = cfg.mla() ? NH : cfg.n_kv_heads;
  const int64_t qk = cfg.qk_head_dim(), v = cfg.value_head_dim();
  ActivationBytes a;
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    a.blocks += e * N * (NH * qk + NKV * qk + NKV * v + C);
    if (cfg.is_dense_layer(l)) a.blocks += e * N * (C + 2 * cfg.dense_ffn_hidden());
  }
  a.once = e * N * cfg.vocab_size;
  return a;
}

}  // namespace moetrain
