#include "train/step_finish.h"

#include <algorithm>

#include "core/check.h"
#include "core/timer.h"

namespace moetrain {

void steer_router_biases(const std::vector<MoeLayer*>& moe, int64_t E, Comm& control,
                         std::vector<GatingController>& gating, double step_s, double tokens,
                         uint64_t step) {
  MOETRAIN_CHECK(gating.size() == moe.size(),
                 "finish_step: {} gating controllers for {} MoE layers", gating.size(), moe.size());
  if (moe.empty()) return;
  std::vector<int64_t> global(moe.size() * E);
  for (std::size_t m = 0; m < moe.size(); ++m)
    std::copy_n(moe[m]->pending_load(), E, global.begin() + m * E);
  control.allreduce(global.data(), static_cast<int64_t>(global.size()));
  // The slowest process sets the step time; every process then feeds the same figures.
  control.allreduce(&step_s, 1, {.op = ReduceOp::Max});
  for (std::size_t m = 0; m < moe.size(); ++m) {
    const std::vector<double> delta =
        gating[m].update({global.data() + m * E, step_s, tokens}, step);
    moe[m]->apply_bias_delta(delta.data());
  }
}

std::vector<std::vector<int64_t>> reduced_loads(Comm& control, const Accumulated& acc) {
  std::vector<int64_t> flat;
  for (const auto& l : acc.tokens_per_expert) flat.insert(flat.end(), l.begin(), l.end());
  control.allreduce(flat.data(), static_cast<int64_t>(flat.size()));
  std::vector<std::vector<int64_t>> out = acc.tokens_per_expert;
  std::size_t at = 0;
  for (auto& l : out)
    for (int64_t& v : l) v = flat[at++];
  return out;
}

namespace {
// The AdamW moments of each optimizer piece, with the piece's flat range.
template <class Fn>
void for_each_moment_piece(ShardedOptimizer& optimizer, Fn&& fn) {
  MOETRAIN_CHECK(optimizer.state_names().size() == 2 && optimizer.state_names()[0] == "exp_avg",
                 "a device keeps AdamW's two moments; this optimizer has {} state buffers",
                 optimizer.state_names().size());
  for (std::size_t p = 0; p < optimizer.pieces().size(); ++p) {
    const OptimPiece& piece = optimizer.pieces()[p];
    fn(piece, optimizer.piece_state(p, 0), optimizer.piece_state(p, 1));
  }
}
}  // namespace

void device_state_to_host(DeviceTrainingState& engine, ShardedOptimizer& optimizer, float* params) {
  for_each_moment_piece(optimizer, [&](const OptimPiece& piece, std::span<float> m,
                                       std::span<float> v) {
    engine.download_state(params, m.data(), v.data(), piece.offset, piece.size);
  });
}

void device_state_to_device(DeviceTrainingState& engine, ShardedOptimizer& optimizer,
                            const float* params) {
  for_each_moment_piece(optimizer, [&](const OptimPiece& piece, std::span<float> m,
                                       std::span<float> v) {
    engine.upload_state(params, m.data(), v.data(), piece.offset, piece.size);
  });
}

StepCommMeter::StepCommMeter(CommThread* thread, const GradReducer& reducer)
    : thread_(thread),
      reducer_(reducer),
      thread_before_(thread ? thread->busy_seconds() : 0.0),
      bytes_before_(reducer.bytes_sent()) {}

CommParts StepCommMeter::parts(const Accumulated& acc, double update_inline_s,
                               double update_blocked_s, bool skipped,
                               double micro_batches) const {
  CommParts p;
  p.thread_s = thread_ ? thread_->busy_seconds() - thread_before_ : 0.0;
  // Without a communication thread the all-to-alls ran inline; with one, its busy time has them.
  p.inline_s = (thread_ ? 0.0 : acc.a2a_s) + update_inline_s;
  p.blocked_s = acc.a2a_wait_s + update_blocked_s;
  p.bytes_a2a = acc.a2a_bytes;
  p.bytes_grad = reducer_.bytes_sent() - bytes_before_;
  p.grad_computations = micro_batches;
  p.grad_discarded = skipped ? micro_batches : 0.0;
  return p;
}

nlohmann::json finish_step(const std::vector<MoeLayer*>& moe, const MoeConfig& moe_cfg,
                           Comm& control, Accumulated& acc, StepFigures figures,
                           std::vector<CapacityController>* capacity, const GatingStep& gating) {
  if (gating.gating) {
    steer_router_biases(moe, moe_cfg.E, control, *gating.gating, gating.step_s, gating.tokens,
                        static_cast<uint64_t>(figures.step));
  } else if (moe_cfg.router == RouterKind::SigmoidBias) {
    update_router_biases(moe, moe_cfg.E, control);
  }
  reduce_step_figures(control, acc, figures.replicas);
  figures.acc = &acc;
  nlohmann::json line = step_metrics_line(figures);
  if (capacity) {
    MOETRAIN_CHECK(capacity->size() == moe.size(),
                   "finish_step: {} capacity controllers for {} MoE layers", capacity->size(),
                   moe.size());
    for (std::size_t m = 0; m < moe.size(); ++m)
      (*capacity)[m].update(capacity_utilisation(acc, m), imbalance(acc.tokens_per_expert[m]));
    apply_capacity_factors(*capacity, moe);
  }
  if (gating.gating) {
    nlohmann::json rewards = nlohmann::json::array();
    for (const GatingController& g : *gating.gating) rewards.push_back(g.last_reward());
    line["gating_reward"] = rewards;
  }
  return line;
}

void apply_capacity_factors(const std::vector<CapacityController>& capacity,
                            const std::vector<MoeLayer*>& moe) {
  for (std::size_t m = 0; m < moe.size(); ++m) {
    const float cf = static_cast<float>(capacity[m].cf());
    moe[m]->set_capacity_factor(moe[m]->config().capacity_factor < 0 ? -cf : cf);
  }
}

}  // namespace moetrain
