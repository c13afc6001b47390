// The Mixtral-style MoE decoder: token embedding; L blocks of [RMSNorm → causal self-attention
// with RoPE and grouped-query heads → residual → RMSNorm → MoE (or dense SwiGLU) → residual];
// final RMSNorm; untied LM head. Parameters live in the caller's flat buffer (see params.h);
// activations for backward live here, sized for the largest (B, T) seen.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/check.h"
#include "model/config.h"
#include "model/cpu_ops.h"
#include "model/model_ops.h"
#include "model/params.h"
#include "model/trainable.h"
#include "moe/moe_layer.h"
#include "moe/recompute.h"

namespace moetrain {

struct LossParts {
  double ce = 0;        // mean cross-entropy over counted targets
  double aux = 0;       // mean over MoE layers of the unweighted aux loss
  double z = 0;         // mean over MoE layers of the unweighted z-loss
  double total = 0;     // ce + aux_coef·aux + z_coef·z
  int64_t targets = 0;  // counted targets (≠ −1)
};

// Keys (after RoPE) and values of one sequence, per layer, for decoding a token at a time.
struct KvCache {
  int64_t capacity = 0;                  // positions it can hold (≤ model.max_seq_len)
  int64_t length = 0;                    // positions filled: the next token's position
  std::vector<std::vector<float>> k, v;  // per layer (capacity, NKV·HS)
  // Work done by decode(), counted so that tests can check it without timing: keys one query of
  // one layer attended to, summed, and the most of them for any one query.
  int64_t keys_attended = 0;
  int64_t max_keys = 0;
};

class DeviceOps;

class Transformer final : public TrainableModel {
 public:
  // ctx: what runs the MoE layers besides this process — the expert exchange and the statistics
  // communicator (default: this process alone). A distributed trainer passes an MPI exchange;
  // the model never sees MPI.
  explicit Transformer(const ModelConfig& cfg, const MoeContext& ctx = {});
  ~Transformer();

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  const ParamTable& param_table() const override { return layout_; }

  // inputs, targets (B, T) int32; targets may be null (no loss; logits only) and −1 skips a
  // position.
  LossParts forward(const float* params, const int32_t* inputs, const int32_t* targets, int64_t B,
                    int64_t T, const MoeStep& step);
  // grads += ∂(loss_weight · total)/∂params for the last forward (which must have had targets).
  void backward(const float* params, float* grads, float loss_weight) override;

  // Pipeline stages: this model runs blocks [first, end) of the stack only — the embedding where
  // first = 0, the final norm, the head and the loss where end = n_layers — and keeps the
  // activations of those alone. The default is every block; a stage computes exactly what the
  // whole model computes for its blocks (the same operations in the same order).
  void set_stage(int64_t first, int64_t end);
  int64_t stage_first() const { return first_; }
  int64_t stage_end() const { return end_; }
  bool last_stage() const { return end_ == cfg_.n_layers; }
  // A stage's forward: a later stage takes x (stage_rows(B·T), C), the previous stage's output,
  // in place of the embedding of `inputs` (not read then); only the last reads `targets`. A
  // stage before the last computes no cross-entropy (its loss parts are its MoE layers' shares
  // of aux and z) and leaves its output in stage_output().
  LossParts forward(const float* params, const int32_t* inputs, const float* x,
                    const int32_t* targets, int64_t B, int64_t T, const MoeStep& step);
  const float* stage_output() const;  // (stage_rows(B·T), C)
  // The rows of a stage's input and output (and of their gradients) on this rank for N tokens:
  // its tokens [t·N/tp, (t+1)·N/tp) under sequence parallelism (the residual stream's rows),
  // else all N.
  int64_t stage_rows(int64_t N) const;
  // A stage's backward: one before the last takes dout = ∂(loss_weight · loss)/∂stage_output();
  // a later one leaves ∂(loss_weight · loss)/∂x in stage_input_grad().
  void backward(const float* params, float* grads, float loss_weight, const float* dout);
  const float* stage_input_grad() const { return dresid_.data(); }
  // Split backward (the zero_bubble pipeline schedule). While on, backward computes the input
  // gradients and every parameter gradient but the weight gradients of the dense linears (the
  // attention's q, k, v and o projections, a dense layer's FFN, the LM head), which it keeps as a
  // list of GEMMs, each with a copy of its output gradient; weight_backward runs that list, the
  // same GEMM calls in the same order, so backward then weight_backward gives the gradients
  // backward gives unsplit, bit for bit. The grads-ready hook is called from weight_backward (a
  // unit's gradients are final only after it). The MoE layers' gradients (router, experts,
  // shared expert) stay in backward. The activations the list reads stay until it ran: a forward
  // or backward before weight_backward is refused. CPU only; not under recompute = full (its
  // blocks share one set of activations).
  void set_split_backward(bool on);
  bool split_backward() const { return split_; }
  void weight_backward(float* grads);
  // The deferred GEMMs' output-gradient copies as allocated (kept for the next micro-batch).
  int64_t deferred_bytes() const;
  // Called during backward whenever the gradients at flat offsets ≥ `ready_from` are final (the
  // layout runs embedding, blocks, final norm, head, and backward visits them in reverse), so a
  // distributed trainer can start reducing them while backward goes on. Empty, or on a device
  // (whose gradients reach the buffer when backward ends): no calls.
  void set_grads_ready_hook(std::function<void(int64_t ready_from)> hook) override {
    grads_ready_ = std::move(hook);
  }
  const std::function<void(int64_t)>& grads_ready_hook() const { return grads_ready_; }

  // Units (ParamUnits): 0 the embedding, 1 + l block l, n_layers + 1 the final norm and the head.
  std::vector<int64_t> unit_starts() const override;
  void set_param_units(ParamUnits* units) override {
    MOETRAIN_CHECK(!units || !on_device(), "sharded parameters (dist.zero = 3) run on the CPU");
    units_ = units;
  }

  // (B·T, V) of the last forward (copied from the device when an engine runs the model); under
  // tensor parallelism (B·T, V / tp), this rank's vocabulary columns.
  const float* logits();

  // Runs forward and backward on a device ("cuda"; "cpu" goes back to this CPU): the same
  // description of the model over that device's operations (model/model_ops.h). Training and
  // evaluation only: prefill and decode run on the CPU. set_precision and hooks do not apply to
  // it (its GEMM mode is DeviceOps::set_gemm).
  void set_device(const std::string& device);
  // Runs forward and backward on these operations instead (another backend's; tests run a CPU
  // stand-in that holds the model to a device's rules: every buffer in its own memory).
  void set_device(std::unique_ptr<DeviceOps> ops);
  const DeviceOps* device_ops() const { return on_device() ? device_.get() : nullptr; }
  DeviceOps* device_ops() { return on_device() ? device_.get() : nullptr; }

  // Inference with a KV cache (no targets, MoE layers in inference mode). The cache's positions
  // are absolute from its first token: RoPE position i is the cache's i-th token.
  KvCache make_kv_cache(int64_t capacity) const;
  // Empties the cache and fills it with tokens (n ≤ capacity) at positions 0..n−1 by one full
  // forward; returns the last position's logits (V).
  const float* prefill(const float* params, const int32_t* tokens, int64_t n, KvCache& cache);
  // One token at position cache.length, attending over the cache and itself; appends its keys and
  // values and returns its logits (V). The cache must not be full.
  const float* decode(const float* params, int32_t token, KvCache& cache);
  // The MoE layers (one per MoE block, in layer order) — stats, router biases, timings.
  std::vector<MoeLayer*> moe_layers() override;
  std::vector<MoeBlockRef> moe_blocks() override;
  int64_t moe_index(int64_t layer) const { return moe_index_[layer]; }  // −1 for dense layers

  // Tensor parallelism (dist.tp; Megatron-style, without sequence parallelism): this process is
  // rank t of `group`'s tp processes, which hold the same parameters and run the same batch. Each
  // computes the attention of heads [t·NH/tp, (t+1)·NH/tp) (the rows of q, k, v and the columns
  // of o they need; an all-reduce sums the o products), a dense FFN's hidden units
  // [t·Fd/tp, (t+1)·Fd/tp) the same way, the LM head's vocabulary columns [t·V/tp, (t+1)·V/tp)
  // with the cross-entropy over the split vocabulary (no process holds whole logits rows), and
  // each MoE layer (router, experts, shared expert) on tokens [t·N/tp, (t+1)·N/tp) of the batch,
  // whose outputs an all-gather joins (the experts' exchange and statistics run over every
  // process, as for data-parallel copies). Embedding, norms and the residual stream are computed
  // whole by every rank, bit for bit the same.
  // Gradients: each rank writes the parameter gradients of what it computed — its rows and
  // columns, its tokens' MoE gradients, and (rank 0 only) those of the replicated embedding and
  // norms — so that summed over the group (as a data-parallel reduction over every process sums
  // them) they are the gradients of the whole model on the batch. The MoE layers' balancing
  // losses run over tp times the token holders: their gradient weight is loss_weight / tp. null
  // or a group of one: off. A pipeline stage (set_stage) runs the same code on its blocks: the
  // embedding on the first stage, the head and the split cross-entropy on the last; its input's
  // and output's activations and gradients are whole on every rank (sequence parallelism: the
  // rank's tokens, stage_rows). CPU only; no prefill or decode under it.
  // sequence_parallel (dist.sequence_parallel, Megatron's sequence parallelism): the residual
  // stream, the norms and the MoE layers run on this rank's tokens [t·N/tp, (t+1)·N/tp) only; an
  // all-gather of the norm's output enters the attention, a dense FFN and the head, and a
  // reduce-scatter (in place of the all-reduce) leaves them, so no rank holds the whole stream.
  // Each rank then writes the embedding's and norms' gradients of its own tokens (their sum over
  // the group is the batch's). In a pipeline stage its input and output are the rank's rows of
  // the stream, which the pipe carries from rank t of one stage to rank t of the next.
  void set_tensor_parallel(Comm* group, bool sequence_parallel = false);
  int64_t tensor_parallel() const { return tp_ ? tp_->size() : 1; }
  bool sequence_parallel() const { return sp_; }

  // Mixed precision. F32 (the default) computes everything in f32. BF16 / F16: every GEMM of
  // the model (projections, experts, dense FFN, LM head) takes its operands rounded to that type
  // — the activations, and a copy of the weights kept from the f32 parameters — and
  // accumulates in f32; embedding, norms, RoPE, the softmax of attention, the router, the
  // losses and every gradient stay f32. In bf16 on a CPU with AVX512_BF16, the attention core's
  // products take bf16 operands too where that pays (attention_bf16_pays: even head size, even
  // 128 ≤ T ≤ 512). The router computes in f32 even then: its top-k decisions are
  // discontinuous, and rounding its inputs would flip near-tied choices.
  void set_precision(DType t);
  DType precision() const { return cpu_->precision(); }
  // The weight copy is rebuilt at the next forward: call after changing the parameters in place
  // (an optimizer step, a load). A forward with a different params pointer rebuilds it anyway.
  void weights_changed() override;
  // The low-precision weight copy, for an optimizer step to write as it updates (Optimizer::step):
  // data only where the copy is current for `params` (a forward with them built it); none in f32.
  LowPrecisionCopy lp_copy_of(const float* params) override;
  // After a step that wrote every parameter it changed into that copy: the copy stays current.
  void weights_changed_copy_kept() override;

  // Model FLOPs per token for forward+backward (6·active params + attention), for MFU.
  double flops_per_token(int64_t T) const;

  // Activation recomputation (moe/recompute.h; train.recompute): none keeps every block's
  // activations; moe drops the MoE layers' expert intermediates and computes them again in
  // backward; full keeps each block's input only (the residual stream) and one set of block
  // activations, running each block's forward again right before its backward. The gradients
  // are the same bits in every mode. CPU only (a device refuses anything but none).
  void set_recompute(Recompute r);
  Recompute recompute() const { return recompute_; }
  // Bytes of activations the model holds now for its backward: the blocks' activations, the
  // residual stream, the head's, and every MoE layer's (MoeLayer::held_bytes), buffers as
  // allocated. After a forward, before any backward, activation_bytes_for predicts it.
  int64_t activation_bytes() const;

 private:
  struct LayerActs;
  void ensure_capacity(int64_t N);
  float* resid_at(int64_t l);  // the residual stream entering block l (l = end_: leaving)
  LayerActs& acts_at(int64_t l);  // block l's activations (the shared set under full)
  void block_forward(int64_t l, const MoeStep& step, bool replay, LossParts* parts);
  void block_backward(int64_t l, float moe_weight);
  void head_backward(const float* params, float loss_weight);
  // A linear layer's backward through the operations (ModelOps::linear_backward_*), its weight
  // gradient deferred under split backward. ld: the weight's row stride when it is a column slice
  // of a wider matrix (0: IC).
  void linear_bwd(float* dinp, bool acc, float* dweight, const float* dout, const float* inp,
                  const void* inp_lp, int64_t w, int64_t N, int64_t IC, int64_t OC, int64_t ld = 0);
  // This rank's share under tensor parallelism (all of it without): heads, key-value heads, their
  // widths and first rows in q / k, v; a dense FFN's hidden units and first; vocabulary columns
  // and first; the MoE layers' tokens of N and first.
  struct TpShard {
    int64_t NH, NKV, QD, KD, q0, k0, Fd, f0, V, v0, Nl, n0;
  };
  TpShard tp_shard(int64_t N) const;
  void tp_allreduce(float* x, int64_t n);
  // out (N, C) = every rank's rows (Nl, C), in rank order.
  void tp_allgather_rows(float* out, const float* mine, int64_t Nl, int64_t C);
  std::vector<int64_t> tp_row_counts(int64_t C) const;
  // A product split over the group's ranks along its reduction: each writes its partial (N, C)
  // to tp_partial(out), and tp_sum(out) makes out the group's sum — whole (an all-reduce in
  // place), or under sequence parallelism this rank's rows of it, (Nl, C) (a reduce-scatter).
  // Without tensor parallelism both leave out as it is.
  float* tp_partial(float* out);
  void tp_sum(float* out, int64_t C);
  // A replicated parameter's gradient: the grads' on rank 0, scratch elsewhere (its sum over the
  // group is then rank 0's); under sequence parallelism every rank's (its tokens' part).
  float* tp_owned(float* grads, int64_t offset, int64_t n);
  // The residual stream's rows on this rank: its tokens under sequence parallelism, else all.
  int64_t stream_rows() const;
  // The grads-ready hook now, or (split backward) in weight_backward at this point of the list.
  void grads_ready(int64_t from);
  // One weight-gradient GEMM of split backward, grads + w (OC, IC) += doutᵀ · inp, or a
  // grads-ready call (ready_from ≥ 0).
  struct DeferredGemm {
    int64_t w = 0, N = 0, IC = 0, OC = 0, ld = 0;
    int64_t ready_from = -1;
    const float* inp = nullptr;     // (N, IC) the slot's activation, kept until then
    const void* inp_lp = nullptr;   // its rounded copy (mixed precision)
    std::vector<float> dout;        // (N, OC) f32
    HalfBuffer dout_lp;             // (N, OC) mixed precision: dout rounded
  };
  DeferredGemm& defer();
  void refresh_lp_weights(const float* params);
  bool on_device() const { return ops_ != cpu_.get(); }
  // Refuses, naming the setting, what only the CPU runs.
  void check_device_runs_it(const std::string& device) const;
  void switch_ops(ModelOps* ops);
  // Frees every activation buffer and the tokens' copies; the next forward allocates them again.
  void release_buffers();

  ModelConfig cfg_;
  ParamLayout layout_;
  // What runs the model: this CPU's operations, or a device's (set_device). Declared before every
  // buffer in their memory.
  std::unique_ptr<CpuOps> cpu_;
  std::unique_ptr<DeviceOps> device_;
  bool device_is_cuda_ = false;  // device_ is make_cuda_ops'
  ModelOps* ops_ = nullptr;
  std::vector<std::unique_ptr<MoeLayer>> moe_;
  std::vector<int64_t> moe_index_;
  std::vector<std::unique_ptr<LayerActs>> acts_;  // (L); under full only the first is used
  Recompute recompute_ = Recompute::None;
  std::unique_ptr<RecomputeScratch> scratch_;  // shared by the MoE layers under moe and full
  int64_t first_ = 0, end_ = 0;  // the stage's blocks [first_, end_)
  KvCache* fill_cache_ = nullptr;  // prefill: the cache each block copies its keys and values to
  int64_t capacity_ = 0;  // tokens the buffers hold
  int64_t B_ = 0, T_ = 0;
  bool have_targets_ = false;
  std::function<void(int64_t)> grads_ready_;
  bool split_ = false;
  std::vector<std::unique_ptr<DeferredGemm>> deferred_;  // reused; the first n_deferred_ pending
  std::size_t n_deferred_ = 0;
  ParamUnits* units_ = nullptr;
  Comm* tp_ = nullptr;  // tensor parallelism's group (null: off)
  bool sp_ = false;     // sequence parallelism
  std::vector<float> tp_rows_, tp_scratch_;  // (Nl, C) a MoE layer's rows; a replicated grad
  std::vector<float> tp_full_;               // (N, C) sequence parallelism's gathered / partial
  std::vector<float> xent_max_;              // (N) split cross-entropy's row maxima
  std::vector<double> xent_sums_;            // (2N) its sums
  // With units: the unit's parameters in place (and their low-precision copy made), or let go.
  void acquire(int64_t unit, int64_t next, const float* params);
  void release(int64_t unit);
  std::pair<int64_t, int64_t> unit_range(int64_t unit) const;  // [begin, end) in floats
  // The CPU's low-precision weight copy (cpu_->weight_copy()): made from these parameters.
  const float* lp_source_ = nullptr;
  bool lp_stale_ = true;
  HalfBuffer lnf_lp_, dout_lp_;  // (N, C), backward scratch (N, max output width)

  // The batch's tokens on the host, and where the operations read them (ids()).
  std::vector<int32_t> inputs_, targets_, pos_;
  Ints inputs_dev_, targets_dev_, pos_dev_;
  const int32_t *inputs_at_ = nullptr, *targets_at_ = nullptr, *pos_at_ = nullptr;
  std::vector<float> logits_host_, losses_host_;  // host copies of logits_, losses_ (to_host)
  // (end − first + 1, N, C): the residual stream entering each of the stage's blocks, then its
  // output
  Floats resid_;
  Floats lnf_, rstdf_;            // (N, C), (N)
  Floats logits_, lse_, losses_;  // (N, V), (N), (N)
  // backward scratch
  // decode scratch, one token: (C), (C), (C), (NH·HS), (KD), (KD), (NH·HS), (C), (Fd) ×3, (V)
  std::vector<float> dx_, dln_tok_, dmid_, dq_tok_, dk_tok_, dv_tok_, datt_tok_, dffn_, dh1_tok_,
      dh3_tok_, dg_tok_, dlogits_tok_;
  HalfBuffer dlp_;
  Floats dresid_, dxmid_, dln_, dq_, dk_, dv_, datt_, dh1_, dh3_, dg_, dlogits_;
};

// The activation bytes one process holds after a training forward of B sequences of T tokens
// under recompute mode r (Transformer::activation_bytes, before any backward), with GEMM operand
// type lp and an expert-parallel group of ep processes: each MoE layer taken as routing N·top_k
// rows (dropless, balanced over the group). Backward scratch, weights and weight copies are not
// included.
int64_t activation_bytes_for(const ModelConfig& cfg, int64_t B, int64_t T, Recompute r, DType lp,
                             int64_t ep = 1);

}  // namespace moetrain
