// The small model: an MoE classifier over flat inputs (Fashion-MNIST images).
//   x (N, D) → linear to C (+ bias) → L blocks of [RMSNorm → MoE (SwiGLU experts) → residual]
//   → RMSNorm → linear to n_classes → softmax cross-entropy
// Parameters live in the caller's flat buffer, laid out by ClassifierLayout; activations for
// backward live here, sized for the largest batch seen.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/params.h"
#include "model/trainable.h"
#include "moe/moe_layer.h"

namespace moetrain {

struct ClassifierConfig : MoeModelConfig {
  ClassifierConfig() { expert_hidden = 128; }

  int64_t input_dim = 784;  // D (28·28 pixels)
  int64_t n_classes = 10;   // V
  int64_t dim = 128;        // C
  int64_t n_layers = 2;     // L
  bool input_bias = true;   // a bias on the input projection
  double norm_eps = 1e-5;
  double init_std = 0.02;

  MoeConfig moe() const { return moe_config(dim); }
  // Throws naming the key ("model.top_k = 9: must be in [1, model.n_experts = 8]").
  void validate() const;
};

// Offsets of one block's tensors (the MoE ones in MoeBlockOffsets); an absent tensor has offset −1.
struct ClassifierBlockOffsets : MoeBlockOffsets {
  int64_t norm = -1;  // (C)
};

// Tensor names follow the LM's Hugging Face style: "model.input_proj.weight",
// "model.layers.{l}.norm.weight", "model.layers.{l}.block_sparse_moe.experts.{j}.w1.weight",
// "model.norm.weight", "classifier.weight".
class ClassifierLayout : public ParamTable {
 public:
  explicit ClassifierLayout(const ClassifierConfig& cfg);

  int64_t input_proj = 0;   // (C, D)
  int64_t input_bias = -1;  // (C), −1 without model.input_bias
  std::vector<ClassifierBlockOffsets> blocks;
  int64_t final_norm = 0;  // (C)
  int64_t head = 0;        // (V, C)
};

// normal(0, init_std) for matrices (expert and shared down-projections scaled by 1/sqrt(2L)),
// ones for norms, zeros for the bias. Counter-based: one stream per tensor.
// tensors_from, tensors_to: as init_params.
void init_classifier_params(float* params, const ClassifierLayout& layout,
                            const ClassifierConfig& cfg, uint64_t seed, int64_t tensors_from = 0,
                            int64_t tensors_to = INT64_MAX);

struct ClassifierLoss {
  double ce = 0;        // mean cross-entropy over the batch
  double aux = 0;       // mean over MoE layers of the unweighted aux loss
  double z = 0;         // mean over MoE layers of the unweighted z-loss
  double total = 0;     // ce + aux_loss_coef·aux + z_loss_coef·z
  int64_t correct = 0;  // rows whose arg-max logit is the label
  int64_t n = 0;        // rows
};

class Classifier final : public TrainableModel {
 public:
  // ctx: what runs the MoE layers (default: this process alone).
  explicit Classifier(const ClassifierConfig& cfg, const MoeContext& ctx = {});
  ~Classifier();

  const ClassifierConfig& config() const { return cfg_; }
  const ClassifierLayout& layout() const { return layout_; }
  const ParamTable& param_table() const override { return layout_; }

  // inputs (N, D); labels (N) in [0, V), or null for logits only (no loss, no backward).
  // `inputs` is read again by backward: keep it valid and unchanged until then.
  ClassifierLoss forward(const float* params, const float* inputs, const int32_t* labels, int64_t N,
                         const MoeStep& step);
  // grads += ∂(loss_weight · total)/∂params for the last forward, which must have had labels.
  void backward(const float* params, float* grads, float loss_weight) override;

  const float* logits() const { return logits_.data(); }  // (N, V) of the last forward
  std::vector<MoeLayer*> moe_layers() override;
  std::vector<MoeBlockRef> moe_blocks() override;

 private:
  void ensure_capacity(int64_t N);

  ClassifierConfig cfg_;
  ClassifierLayout layout_;
  std::vector<std::unique_ptr<MoeLayer>> moe_;
  int64_t capacity_ = 0;
  int64_t N_ = 0;
  const float* inputs_ = nullptr;  // (N, D) of the last forward
  bool have_labels_ = false;

  std::vector<int32_t> labels_;  // (N)
  std::vector<float> resid_;     // (L+1, N, C): the stream entering each block, then the output
  std::vector<float> ln_, rstd_, ffn_;                        // (L, N, C), (L, N), (N, C)
  std::vector<float> lnf_, rstdf_;                            // (N, C), (N)
  std::vector<float> logits_, lse_, losses_;                  // (N, V), (N), (N)
  std::vector<float> dresid_, dln_, dx_, dlogits_, dlosses_;  // (N, C) ×3, (N, V), (N)
};

}  // namespace moetrain
