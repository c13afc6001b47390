// An optimizer over several disjoint ranges of the flat buffer, one Optimizer per range: the
// ranges a rank updates (its replicated parameters and its experts, or under ZeRO-1 its shard).
// Updates are elementwise, so an element gets the same bits whichever rank and range update it.
// Checkpoints read and write each piece's state in place, by parameter name and element range
// (io/checkpoint.h), so a checkpoint of one layout loads into any other.
//
// With an offload file (dist.offload = host_file) the state of every piece lives in that file
// (optim/offload_store.h), not in memory: a step streams it through in chunks, each chunk updated
// by the same optimizer code as the in-memory state (Optimizer::step_part), so parameters and
// state come out bitwise the same; piece_state() then maps the file, read_state() and
// write_state() copy ranges of it.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace moetrain {

struct OptimPiece {
  int64_t offset = 0, size = 0;
};

// Where the state of a ShardedOptimizer lives: an empty path keeps it in memory.
struct StateOffload {
  std::string path;             // the file (one per process), removed when the optimizer goes
  int64_t chunk = int64_t{1} << 20;  // elements per state buffer streamed at a time
};

class OffloadStore;

class ShardedOptimizer {
 public:
  ShardedOptimizer(const OptimizerConfig& config, std::span<const ParamRange> groups,
                   std::vector<OptimPiece> pieces, const StateOffload& offload = {});
  ~ShardedOptimizer();

  // params, grads: the whole flat buffers; only the pieces are read and written, less the frozen
  // ranges (Optimizer::step). lp: the whole low-precision copy, whose pieces are written too.
  void step(float* params, const float* grads, float lr, std::span<const FrozenRange> frozen = {},
            const LowPrecisionCopy& lp = {});
  // The same, each piece's gradients read from piece_grads[k] (its size values) rather than from
  // a flat buffer (ZeRO-2 steps on the packed shard).
  void step(float* params, std::span<const float* const> piece_grads, float lr,
            std::span<const FrozenRange> frozen = {}, const LowPrecisionCopy& lp = {});
  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t steps);

  const std::vector<OptimPiece>& pieces() const { return pieces_; }
  // Names of the state buffers ("exp_avg", "exp_avg_sq" for AdamW), in state() order.
  const std::vector<std::string>& state_names() const { return names_; }
  // State buffer `s` of piece `piece`: (pieces()[piece].size) values for the flat elements
  // [offset, offset + size). Offloaded: a view of the file, valid until the next step().
  std::span<float> piece_state(std::size_t piece, int s);
  // Copies elements [at, at + n) of state buffer s of `piece` out, or in: from memory, or from the
  // offload file without mapping it (what checkpoints use, a window at a time).
  void read_state(std::size_t piece, int s, int64_t at, int64_t n, float* out);
  void write_state(std::size_t piece, int s, int64_t at, int64_t n, const float* in);
  // The offload store, or null when the state is in memory.
  OffloadStore* offload_store() const { return store_.get(); }

 private:
  std::vector<OptimPiece> pieces_;
  std::vector<std::unique_ptr<Optimizer>> opts_;  // one per piece
  std::vector<std::string> names_;
  int64_t step_count_ = 0;
  std::unique_ptr<OffloadStore> store_;
};

}  // namespace moetrain
