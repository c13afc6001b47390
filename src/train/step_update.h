// The end of every trainer's step, after the accumulation routine: the gradient reduction and
// the one update step (optim/update.h) with the optimizer, then the aux-loss-free router's bias
// update, the step's figures reduced over the processes and its metrics line.
#pragma once
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm.h"
#include "moe/capacity_controller.h"
#include "moe/config.h"
#include "optim/device_state.h"
#include "moe/gating_controller.h"
#include "optim/grad_reducer.h"
#include "optim/update.h"
#include "parallel/comm_thread.h"
#include "parallel/sharded_optimizer.h"
#include "train/accumulate.h"
#include "train/step_metrics.h"

namespace moetrain {

struct StepUpdate {
  UpdateOutcome outcome;
  double inline_s = 0;   // the reducer communicated on this thread (GradReducer::inline_seconds)
  double blocked_s = 0;  // this thread ran or waited for the reduction and the gathers
  // The step wrote every parameter it changed into the low-precision copy too: the copy is
  // current (false: it is stale, or there was none).
  bool lp_copy_kept = false;
};

// Collective over control and the reducer's groups: params (n) stepped at lr by the optimizer
// from the reduced grads (n), unless apply_update skips the step. The optimizer leaves the frozen
// ranges alone (sparse experts). lp: the model's low-precision copy of params, current before the
// step; the optimizer writes the elements it changes into it in its own pass, unless the reducer
// then changes others (ZeRO-1's gather).
StepUpdate reduce_and_update(GradReducer& reducer, ShardedOptimizer& optimizer, Comm& control,
                             float* params, float* grads, float lr, const UpdateOptions& opts,
                             std::span<const FrozenRange> frozen = {},
                             const LowPrecisionCopy& lp = {});

// The same step with the gradients and the optimizer state on a resident device engine
// (train.device = cuda, one process): apply_update on the engine's gradient, then AdamW on the
// engine at the optimizer's next step, whose count the host optimizer keeps (checkpoints record it).
StepUpdate device_update(DeviceTrainingState& engine, ShardedOptimizer& optimizer,
                         const OptimizerConfig& config, std::span<const ParamRange> groups,
                         Comm& control, float lr, const UpdateOptions& opts);
// Parameters and optimizer moments between the host buffers (params, the optimizer's pieces) and
// a resident engine: to_host before anything reads the host copies (a checkpoint), to_device
// before the first step and after the host copies changed (a load).
void device_state_to_host(DeviceTrainingState& engine, ShardedOptimizer& optimizer, float* params);
void device_state_to_device(DeviceTrainingState& engine, ShardedOptimizer& optimizer,
                            const float* params);

// A step's communication (train/step_metrics.h CommParts), from readings taken at its start.
// thread: the communication thread (null: none), which runs the all-to-alls when there is one.
class StepCommMeter {
 public:
  StepCommMeter(CommThread* thread, const GradReducer& reducer);
  // After reduce_and_update. step_s is left to the caller (the step's wall time); a skipped
  // update discards the step's micro_batches gradient computations.
  CommParts parts(const Accumulated& acc, const StepUpdate& up, double micro_batches) const;

 private:
  CommThread* thread_;
  const GradReducer& reducer_;
  double thread_before_ = 0;
  int64_t bytes_before_ = 0;
};

// Collective over control: acc's tokens per expert (MoE layers, E) summed over the processes,
// for what needs them before finish_step reduces acc itself (the utilisation reweighting).
std::vector<std::vector<int64_t>> reduced_loads(Comm& control, const Accumulated& acc);

// Collective over control: the router-bias update (sigmoid_bias routers), acc reduced over the
// processes, and the metrics line of figures (whose acc is set to &acc here). capacity (one
// controller per MoE layer, or null for a fixed capacity): each is updated from its layer's
// reduced utilisation and imbalance, the figures the line records, and sets its layer's factor
// for the next step — the same on every process.
// gating (one controller per MoE layer, or null for the sign rule): each takes its layer's
// reduced load, the slowest process's step_s and the step's tokens, and sets its layer's bias;
// the line records its reward.
struct GatingStep {
  std::vector<GatingController>* gating = nullptr;
  double step_s = 0;  // this process's time for the step so far
  double tokens = 0;  // trained on by every process
};
nlohmann::json finish_step(const std::vector<MoeLayer*>& moe, const MoeConfig& moe_cfg,
                           Comm& control, Accumulated& acc, StepFigures figures,
                           std::vector<CapacityController>* capacity = nullptr,
                           const GatingStep& gating = {});

// Collective over control: the gating controllers' bias update in place of the sign rule.
void steer_router_biases(const std::vector<MoeLayer*>& moe, int64_t E, Comm& control,
                         std::vector<GatingController>& gating, double step_s, double tokens,
                         uint64_t step);

// Sets each layer's capacity factor from its controller, keeping the sign of the layer's
// configured factor (its mode).
void apply_capacity_factors(const std::vector<CapacityController>& capacity,
                            const std::vector<MoeLayer*>& moe);

}  // namespace moetrain
