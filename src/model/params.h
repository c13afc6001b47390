// One parameter table per model: every tensor is a named view into one contiguous float buffer,
// laid out from the config. Gradients and optimizer moments mirror it (same offsets), so
// reduction, sharding and checkpoints are loops over one flat buffer. Names are Hugging Face
// Mixtral's, so a checkpoint loads in transformers.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace moetrain {

struct ParamInfo {
  std::string name;  // e.g. "model.layers.0.self_attn.q_proj.weight"
  Shape shape;
  int64_t offset = 0;  // in floats, into the flat buffer
  int64_t numel = 0;
  bool decay = true;    // AdamW weight decay (off for norms)
  int64_t expert = -1;  // global expert id for expert weights, else -1
};

// Offsets of an MoE block's tensors, in any model. An absent tensor has offset -1.
struct MoeBlockOffsets {
  int64_t gate = -1, noise = -1;                           // (E, C)
  int64_t w1 = -1, w3 = -1, w2 = -1;                       // (E, F, C), (E, F, C), (E, C, F)
  int64_t shared_w1 = -1, shared_w3 = -1, shared_w2 = -1;  // (Fs, C), (Fs, C), (C, Fs)
};

// The MoE weights of a block as views into a flat buffer (parameters or gradients), with, in
// mixed precision (lp bf16 or fp16), the experts' rounded copies in lp_base at the same offsets
// (2-byte elements).
MoeWeights moe_weights(float* base, const MoeBlockOffsets& o, DType lp = DType::F32,
                       const void* lp_base = nullptr);

// Offsets of one block's tensors (MoE blocks: MoeBlockOffsets). An absent tensor has offset -1.
struct LayerOffsets : MoeBlockOffsets {
  int64_t ln1, ln2;        // (C)
  int64_t wq, wk, wv, wo;  // (NH·HS, C), (NKV·HS, C), (NKV·HS, C), (C, NH·HS)
  // dense blocks
  int64_t mlp_w1 = -1, mlp_w3 = -1, mlp_w2 = -1;  // (Fd, C), (Fd, C), (C, Fd)
};

// A table of named tensors laid out one after another in a flat buffer, each on a 64-byte
// boundary. Models build theirs from their config (ParamLayout, ClassifierLayout).
class ParamTable {
 public:
  int64_t size() const { return size_; }  // floats in the buffer
  const std::vector<ParamInfo>& params() const { return params_; }
  const ParamInfo& find(const std::string& name) const;  // throws naming the missing tensor
  const ParamInfo* find_or_null(const std::string& name) const;

 protected:
  // Appends a tensor and returns its offset.
  int64_t add(std::string name, Shape shape, bool decay, int64_t expert = -1);
  // E experts' `which` matrices as one (E, per_expert...) block, each listed under
  // "{prefix}.experts.{j}.{which}.weight"; returns the block's offset.
  int64_t add_experts(const std::string& prefix, const char* which, int64_t E, Shape per_expert);
  // An MoE block's tensors under "{prefix}.gate.weight", "{prefix}.experts.{j}.w1.weight", ...
  // (prefix e.g. "model.layers.0.block_sparse_moe"): gate, noise (noisy_topk), the experts'
  // w1, w3, w2, the shared expert's gate, up and down projections (shared_F > 0).
  MoeBlockOffsets add_moe_block(const std::string& prefix, const MoeConfig& m);
  // Pads the buffer to the alignment, after the last tensor.
  void finish();

 private:
  std::vector<ParamInfo> params_;
  int64_t size_ = 0;
};

class ParamLayout : public ParamTable {
 public:
  explicit ParamLayout(const ModelConfig& cfg);

  int64_t embed = 0;  // (V, C)
  std::vector<LayerOffsets> layers;
  int64_t final_norm = 0;  // (C)
  int64_t lm_head = 0;     // (V, C)
};

// Fills a flat parameter buffer as the config says: normal(0, init_std) for matrices (output
// projections scaled by 1/sqrt(2L), as GPT-2 does), ones for norms. Counter-based: the same
// seed gives the same model whatever the thread count.
// tensors_from, tensors_to: only the tensors whose offsets lie in [tensors_from, tensors_to) are
// filled (the same values as a whole fill gives them).
void init_params(float* params, const ParamLayout& layout, const ModelConfig& cfg, uint64_t seed,
                 int64_t tensors_from = 0, int64_t tensors_to = INT64_MAX);

// What every model's init is: normal(0, init_std) for matrices, residual-branch outputs
// (o_proj, the experts' w2, down_proj) scaled by 1/sqrt(2·n_layers); ones for vectors, zeros for
// biases. One counter-based stream per tensor of the table.
void init_table_params(float* params, const ParamTable& table, double init_std, int64_t n_layers,
                       uint64_t seed, int64_t tensors_from = 0, int64_t tensors_to = INT64_MAX);

}  // namespace moetrain
