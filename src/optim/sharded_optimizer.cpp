#include "optim/sharded_optimizer.h"

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "core/profile.h"
#include "optim/offload_store.h"

namespace moetrain {

ShardedOptimizer::ShardedOptimizer(const OptimizerConfig& config,
                                   std::span<const ParamRange> groups,
                                   std::vector<OptimPiece> pieces,
                                   const StateOffload& offload)
    : pieces_(std::move(pieces)) {
  // An empty range gives the state names even to a rank without pieces.
  std::vector<float> initial;
  const std::unique_ptr<Optimizer> empty = make_optimizer(config, groups, 0, 0);
  for (const StateSpec& sp : empty->state_specs()) {
    names_.push_back(sp.name);
    initial.push_back(sp.initial);
  }
  const StateStorage storage = offload.path.empty() ? StateStorage::Owned : StateStorage::External;
  std::vector<int64_t> sizes;
  for (const OptimPiece& p : pieces_) {
    MOETRAIN_CHECK(p.offset >= 0 && p.size >= 0, "optimizer piece [{}, +{}) is invalid", p.offset,
                   p.size);
    opts_.push_back(make_optimizer(config, groups, p.offset, p.offset + p.size, storage));
    sizes.push_back(p.size);
  }
  if (storage == StateStorage::External)
    store_ = std::make_unique<OffloadStore>(offload.path, std::move(sizes), std::move(initial),
                                            offload.chunk);
}

ShardedOptimizer::~ShardedOptimizer() = default;

void ShardedOptimizer::step(float* params, const float* grads, float lr,
                            std::span<const FrozenRange> frozen, const LowPrecisionCopy& lp) {
  std::vector<const float*> piece_grads;
  for (auto& o : opts_) piece_grads.push_back(grads + o->begin());
  step(params, piece_grads, lr, frozen, lp);
}

void ShardedOptimizer::step(float* params, std::span<const float* const> piece_grads, float lr,
                            std::span<const FrozenRange> frozen, const LowPrecisionCopy& lp) {
  MOETRAIN_CHECK(piece_grads.size() == opts_.size(), "{} gradient pieces for {} optimizer pieces",
                 piece_grads.size(), opts_.size());
  if (!store_) {
    for (std::size_t k = 0; k < opts_.size(); ++k) {
      Optimizer& o = *opts_[k];
      o.step(params + o.begin(), piece_grads[k], lr, frozen, lp.at(o.begin()));
    }
  } else {
    // The whole stream, waits for the disk included, is the optimizer's time.
    PhaseScope phase_scope(Phase::Optimizer);
    for (auto& o : opts_) o->begin_step(lr, frozen);
    struct Ending {
      std::vector<std::unique_ptr<Optimizer>>& opts;
      ~Ending() {
        for (auto& o : opts) o->end_step();
      }
    } ending{opts_};
    store_->stream([&](std::size_t k, int64_t lo, int64_t hi, float* const* state) {
      Optimizer& o = *opts_[k];
      const int64_t at = o.begin() + lo;
      o.step_part(lo, hi, params + at, piece_grads[k] + lo, state, lp.at(at));
    });
  }
  ++step_count_;
}

void ShardedOptimizer::set_step_count(int64_t steps) {
  MOETRAIN_CHECK(steps >= 0, "optimizer step count {} must be >= 0", steps);
  for (auto& o : opts_) o->set_step_count(steps);
  step_count_ = steps;
}

std::span<float> ShardedOptimizer::piece_state(std::size_t piece, int s) {
  MOETRAIN_CHECK(piece < opts_.size(), "optimizer piece {} of {}", piece, opts_.size());
  MOETRAIN_CHECK(s >= 0 && static_cast<std::size_t>(s) < names_.size(),
                 "optimizer state buffer {} of {}", s, names_.size());
  if (store_) return store_->map(piece, s);
  return opts_[piece]->state().at(static_cast<std::size_t>(s)).values;
}

}  // namespace moetrain

namespace moetrain {

void ShardedOptimizer::read_state(std::size_t piece, int s, int64_t at, int64_t n, float* out) {
  if (store_) return store_->read(piece, s, at, n, out);
  const std::span<float> v = piece_state(piece, s);
  MOETRAIN_CHECK(at >= 0 && n >= 0 && at + n <= static_cast<int64_t>(v.size()),
                 "optimizer state [{}, {}) of piece {}: it has {} elements", at, at + n, piece,
                 v.size());
  std::copy_n(v.data() + at, n, out);
}

void ShardedOptimizer::write_state(std::size_t piece, int s, int64_t at, int64_t n,
                                   const float* in) {
  if (store_) return store_->write(piece, s, at, n, in);
  const std::span<float> v = piece_state(piece, s);
  MOETRAIN_CHECK(at >= 0 && n >= 0 && at + n <= static_cast<int64_t>(v.size()),
                 "optimizer state [{}, {}) of piece {}: it has {} elements", at, at + n, piece,
                 v.size());
  std::copy_n(in, n, v.data() + at);
}

}  // namespace moetrain
