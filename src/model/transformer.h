// The Mixtral-style MoE decoder: token embedding; L blocks of [RMSNorm → causal self-attention
// with RoPE and grouped-query heads → residual → RMSNorm → MoE (or dense SwiGLU) → residual];
// final RMSNorm; untied LM head. Parameters live in the caller's flat buffer (see params.h);
// activations for backward live here, sized for the largest (B, T) seen.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "model/config.h"
#include "model/params.h"
#include "moe/moe_layer.h"

namespace moetrain {

struct LossParts {
  double ce = 0;        // mean cross-entropy over counted targets
  double aux = 0;       // mean over MoE layers of the unweighted aux loss
  double z = 0;         // mean over MoE layers of the unweighted z-loss
  double total = 0;     // ce + aux_coef·aux + z_coef·z
  int64_t targets = 0;  // counted targets (≠ −1)
};

// Builds the layer that runs each MoE block; the default is a MoeLayer on this process. A
// distributed trainer passes one that builds expert-parallel layers (the model never sees MPI).
using MoeFactory = std::function<std::unique_ptr<MoeBlock>(const MoeConfig&)>;

class Transformer {
 public:
  explicit Transformer(const ModelConfig& cfg, const MoeFactory& make_moe = {});
  ~Transformer();

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }

  // inputs, targets (B, T) int32; targets may be null (no loss; logits only) and −1 skips a
  // position.
  LossParts forward(const float* params, const int32_t* inputs, const int32_t* targets, int64_t B,
                    int64_t T, const MoeStep& step);
  // grads += ∂(loss_weight · total)/∂params for the last forward (which must have had targets).
  void backward(const float* params, float* grads, float loss_weight);
  // Called during backward whenever the gradients at flat offsets ≥ `ready_from` are final (the
  // layout runs embedding, blocks, final norm, head, and backward visits them in reverse), so a
  // distributed trainer can start reducing them while backward goes on. Empty: no calls.
  void set_grads_ready_hook(std::function<void(int64_t ready_from)> hook) {
    grads_ready_ = std::move(hook);
  }

  const float* logits() const { return logits_.data(); }  // (B·T, V) of the last forward
  // The MoE layers (one per MoE block, in layer order) — stats, router biases, timings.
  std::vector<MoeBlock*> moe_layers();
  int64_t moe_index(int64_t layer) const { return moe_index_[layer]; }  // −1 for dense layers

  // Model FLOPs per token for forward+backward (6·active params + attention), for MFU.
  double flops_per_token(int64_t T) const;

 private:
  struct LayerActs;
  void ensure_capacity(int64_t N);

  ModelConfig cfg_;
  ParamLayout layout_;
  std::vector<std::unique_ptr<MoeBlock>> moe_;
  std::vector<int64_t> moe_index_;
  std::vector<std::unique_ptr<LayerActs>> acts_;
  int64_t capacity_ = 0;  // tokens the buffers hold
  int64_t B_ = 0, T_ = 0;
  bool have_targets_ = false;
  std::function<void(int64_t)> grads_ready_;

  std::vector<int32_t> inputs_, targets_, pos_;
  std::vector<float>
      resid_;  // (L+1, N, C): the residual stream entering each block, then the output
  std::vector<float> lnf_, rstdf_;            // (N, C), (N)
  std::vector<float> logits_, lse_, losses_;  // (N, V), (N), (N)
  // backward scratch
  std::vector<float> dresid_, dxmid_, dln_, dq_, dk_, dv_, datt_, dh1_, dh3_, dg_, dlogits_;
};

}  // namespace moetrain
