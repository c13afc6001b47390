// The end of the step engine's step (train/step_engine.h), after the update: the aux-loss-free
// router's bias update and the controllers (dynamic capacity, RL gating), the step's figures
// reduced over the processes and its metrics line, the step's communication; and moving a
// resident device's state to and from the host.
#pragma once
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm.h"
#include "moe/capacity_controller.h"
#include "moe/config.h"
#include "moe/gating_controller.h"
#include "optim/device_state.h"
#include "optim/sharded_optimizer.h"
#include "optim/update.h"
#include "parallel/comm_thread.h"
#include "parallel/reducer.h"
#include "train/accumulate.h"
#include "train/step_metrics.h"

namespace moetrain {

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
  // After the update: update_inline_s and update_blocked_s are the update's communication on
  // this thread and its waits. step_s is left to the caller (the step's wall time); a skipped
  // update discards the step's micro_batches gradient computations.
  CommParts parts(const Accumulated& acc, double update_inline_s, double update_blocked_s,
                  bool skipped, double micro_batches) const;

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
