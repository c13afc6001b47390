// Sparse expert gradients ([grad] sparse_experts): an expert that no token reached in a step is
// not reduced and not updated. Each (MoE layer m, expert e) has a key m·E + e; a step's mask says
// which keys are active:
//   - touched: at least one token of the global batch reached the expert (after capacity dropping)
//     in micro-batch a; counted per micro-batch index a over every process (micro-batch a of all
//     processes is one slice of the global batch), so the count is in [0, A];
//   - active: touched in at least max(1, ceil(p·A)) of the A micro-batches (p =
//     grad.min_accum_fraction; 0 means one is enough). An expert touched in fewer has its
//     accumulated gradient discarded for the step.
// Every process computes the same mask from one sum all-reduce of (A, layers, E) counts, before
// the step's last backward, so overlapped buckets can already skip the inactive experts.
// An inactive expert's parameters and optimizer state stay bit for bit as they were (lazy Adam,
// PyTorch SparseAdam: no moment decay, no weight decay); the step count is global, so a row
// updated again later is bias-corrected with the global t. Its gradient rows are zeroed locally,
// so the gradient norm and the non-finite check see only active experts and dense parameters.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/comm.h"
#include "model/params.h"
#include "optim/optimizer.h"

namespace moetrain {

// One expert tensor of the layout (layout order) and its key.
struct ExpertPiece {
  int64_t offset = 0, size = 0;
  int64_t key = 0;  // m·E + e
};

// The layout's expert tensors with their keys: m numbers the MoE blocks in layout order (the order
// of the model's moe_layers()), E is the number of experts per block.
std::vector<ExpertPiece> expert_pieces(const ParamTable& layout);

// max(1, ceil(p·A)): the micro-batches an expert must be touched in to be updated.
int64_t min_touched_micro_batches(int64_t A, double p);

// counts (A·keys): tokens each key received in each micro-batch (global sums). Returns (keys) 1
// for an active key, 0 for an inactive one.
std::vector<uint8_t> active_experts(std::span<const int64_t> counts, int64_t A, int64_t keys,
                                    double p);

// The pieces whose key is inactive, as ranges the optimizer leaves alone.
std::vector<FrozenRange> frozen_ranges(std::span<const ExpertPiece> pieces,
                                       std::span<const uint8_t> active);

// One run's mask: the trainer records each micro-batch's routing, agrees on the mask before the
// last backward, zeroes the inactive rows after it, and steps the optimizer around them.
class SparseExperts {
 public:
  // E: experts per MoE layer; layers: MoE layers; A: micro-batches per step.
  SparseExperts(const ParamTable& layout, int64_t layers, int64_t E, int64_t A, double p);

  // Clears the step's record (call before the first micro-batch).
  void start_step();
  // After micro-batch `micro`'s forward: tokens_per_expert of each MoE layer (this process's,
  // after dropping).
  void record(int64_t micro, int64_t layer, const int64_t* tokens_per_expert);
  // The MoE layers (layers) this process's mask decides: dist.pp > 1 gives each stage its own
  // layers, which only its processes route. The others' keys count as active here (nothing of
  // them is reduced or stepped on this process) and stay out of inactive() and masked_share().
  // Every layer by default.
  void hold_layers(std::vector<uint8_t> held);
  // Collective over comm (every process whose tokens reach the held layers: the world, or a
  // stage's copies): the mask from every micro-batch.
  void agree(Comm& comm);
  // Collective over comm (the pipe: one process of each stage, which hold disjoint layers):
  // inactive() and masked_share() become the whole model's. The mask stays this process's.
  void sum_figures(Comm& comm);

  // (A, layers, E) the tokens each expert received in each micro-batch of the step: this
  // process's as recorded, summed over every process once agree ran. A parameter-server worker
  // pushes its record, and the servers take the mask from the sum (ps/options.h).
  std::span<const int64_t> counts() const { return counts_; }
  std::span<const uint8_t> active() const { return active_; }
  std::span<const FrozenRange> frozen() const { return frozen_; }
  int64_t inactive() const { return inactive_; }  // keys frozen this step
  // Of the (expert, micro-batch) pairs that computed a gradient this step, the share whose
  // gradient min_accum_fraction discarded (0 when it masks nothing).
  double masked_share() const { return masked_share_; }
  // grads at the frozen ranges = 0 (local; their reduction is skipped). Call once a step, after
  // the last backward: it also records that those rows hold zeros for zero_grads.
  void zero_frozen(float* grads);
  // The start of a step: grads[0, n) = 0, except the rows of experts inactive in the previous
  // step, which zero_frozen left at zero and nothing wrote since (an untouched expert costs no
  // zeroing either).
  void zero_grads(float* grads, int64_t n) const;

 private:
  std::vector<ExpertPiece> pieces_;
  int64_t layers_, E_, A_;
  double p_;
  std::vector<int64_t> counts_;  // (A, layers, E)
  std::vector<uint8_t> active_;
  std::vector<FrozenRange> frozen_;
  std::vector<uint8_t> held_;  // (layers) hold_layers
  int64_t inactive_ = 0;
  // (expert, micro-batch) pairs that computed a gradient, and those of them masked.
  int64_t touched_ = 0, masked_ = 0;
  double masked_share_ = 0;
  std::vector<uint8_t> known_zero_;  // (keys) rows that hold zeros since the last zero_frozen
};

}  // namespace moetrain
