// The training state a device keeps resident (model/device_ops.h, the CUDA backend):
// the gradients, summed on the device over a step's micro-batches from zero_grads() on; the one
// update step (optim/update.h) runs on gradient(); AdamW steps the device parameters and moments,
// which the host sees only through download_state / upload_state (checkpoints, resume).
#pragma once
#include <cstdint>
#include <span>

#include "optim/optimizer.h"
#include "optim/update.h"

namespace moetrain {

class DeviceTrainingState {
 public:
  virtual ~DeviceTrainingState() = default;
  // On: backward keeps the gradients on the device and leaves the host buffer alone.
  virtual void set_resident(bool on) = 0;
  virtual void zero_grads() = 0;
  virtual GradientShard& gradient() = 0;
  // AdamW (optim/adamw.h, bitwise its update) over the groups at lr, t the 1-based step.
  virtual void adamw_step(const OptimizerConfig& config, std::span<const ParamRange> groups,
                          float lr, int64_t t) = 0;
  // Parameters (layout size, in full) and the AdamW moments of the flat elements
  // [offset, offset + n).
  virtual void download_state(float* params, float* exp_avg, float* exp_avg_sq, int64_t offset,
                              int64_t n) = 0;
  virtual void upload_state(const float* params, const float* exp_avg, const float* exp_avg_sq,
                            int64_t offset, int64_t n) = 0;
};

}  // namespace moetrain
