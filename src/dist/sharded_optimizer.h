// An optimizer over several disjoint ranges of the flat buffer, one Optimizer per range: the
// ranges a rank updates (its replicated parameters and its experts, or under ZeRO-1 its shard).
// Updates are elementwise, so an element gets the same bits whichever rank and range update it.
// Checkpoints hold every state buffer whole, by parameter name: gather_state assembles it on one
// rank from the ranges each rank is the writer of, load_state takes a rank's ranges out of it.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dist/comm.h"
#include "optim/optimizer.h"

namespace moetrain {

struct OptimPiece {
  int64_t offset = 0, size = 0;
  // Whether this rank writes the piece's state into checkpoints: exactly one rank per element.
  bool writer = true;
};

// Collective over comm: every rank's pieces (flat offset, size, data) are copied into `full`
// (flat) on `root`; `full` is not read or written elsewhere. Pieces on root may alias `full`.
struct FlatPiece {
  int64_t offset = 0, size = 0;
  const float* data = nullptr;
};
void gather_pieces(Comm& comm, std::span<const FlatPiece> pieces, float* full, int root = 0);

class ShardedOptimizer {
 public:
  ShardedOptimizer(const OptimizerConfig& config, std::span<const ParamRange> groups,
                   std::vector<OptimPiece> pieces);

  // params, grads: the whole flat buffers; only the pieces are read and written.
  void step(float* params, const float* grads, float lr);
  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t steps);

  const std::vector<OptimPiece>& pieces() const { return pieces_; }
  // Names of the state buffers ("exp_avg", "exp_avg_sq" for AdamW), in state() order.
  const std::vector<std::string>& state_names() const { return names_; }
  // Views of state buffer `s` over the whole flat buffer, when one piece covers [0, total):
  // the single-process case, whose checkpoints read and write the state in place.
  std::span<float> whole_state(int s);

  // Collective over comm: state `s` of every writer piece into full (flat, total) on root.
  void gather_state(Comm& comm, int s, float* full, int root = 0);
  // State `s` of this rank's pieces = full (flat) at their offsets.
  void load_state(int s, const float* full);

 private:
  std::vector<OptimPiece> pieces_;
  std::vector<std::unique_ptr<Optimizer>> opts_;  // one per piece
  std::vector<std::string> names_;
  int64_t step_count_ = 0;
};

}  // namespace moetrain
