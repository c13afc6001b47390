#include "optim/sharded_optimizer.h"

#include "core/check.h"

namespace moetrain {

ShardedOptimizer::ShardedOptimizer(const OptimizerConfig& config,
                                   std::span<const ParamRange> groups,
                                   std::vector<OptimPiece> pieces)
    : pieces_(std::move(pieces)) {
  // An empty range gives the state names even to a rank without pieces.
  for (const StateBuffer& sb : make_optimizer(config, groups, 0, 0)->state())
    names_.push_back(sb.name);
  for (const OptimPiece& p : pieces_) {
    MOETRAIN_CHECK(p.offset >= 0 && p.size >= 0, "optimizer piece [{}, +{}) is invalid", p.offset,
                   p.size);
    opts_.push_back(make_optimizer(config, groups, p.offset, p.offset + p.size));
  }
}

void ShardedOptimizer::step(float* params, const float* grads, float lr,
                            std::span<const FrozenRange> frozen, const LowPrecisionCopy& lp) {
  for (auto& o : opts_)
    o->step(params + o->begin(), grads + o->begin(), lr, frozen, lp.at(o->begin()));
  ++step_count_;
}

void ShardedOptimizer::step(float* params, std::span<const float* const> piece_grads, float lr,
                            std::span<const FrozenRange> frozen, const LowPrecisionCopy& lp) {
  MOETRAIN_CHECK(piece_grads.size() == opts_.size(), "{} gradient pieces for {} optimizer pieces",
                 piece_grads.size(), opts_.size());
  for (std::size_t k = 0; k < opts_.size(); ++k) {
    Optimizer& o = *opts_[k];
    o.step(params + o.begin(), piece_grads[k], lr, frozen, lp.at(o.begin()));
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
  return opts_[piece]->state().at(static_cast<std::size_t>(s)).values;
}

}  // namespace moetrain
