// A device's operations (model/model_ops.h): the Transformer's one description of its forward
// and backward, run somewhere other than this CPU (the CUDA backend, src/cuda/ops.h). The caller
// keeps the host parameter and gradient buffers, so the update step, checkpoints and metrics are
// the CPU path's: the device uploads the parameters when they change and adds its gradients into
// the host buffer (or keeps them resident for the trainer, training_state). Routing stays in the
// model's MoeLayer objects (the same decisions, statistics and balancing losses as on the CPU).
#pragma once
#include <memory>
#include <string>

#include "core/dtype.h"
#include "model/model_ops.h"

namespace moetrain {

class DeviceTrainingState;  // optim/device_state.h
class Transformer;

class DeviceOps : public ModelOps {
 public:
  // The operands of the model's GEMMs (core/dtype.h): f32 (the default), TF32 or bf16. The
  // router's GEMMs stay f32 in every mode, as on the CPU.
  virtual void set_gemm(DeviceGemm g) = 0;
  // Attention's products follow the GEMM mode: on the tensor cores with TF32 or bf16 operands.
  // With this on they stay f32 in every mode, as the CPU's bf16 precision keeps them (for a
  // comparison with it).
  virtual void keep_attention_f32(bool on) = 0;
  // Waits for the work queued on the device (timings).
  virtual void synchronize() = 0;
  // What runs the model, for the log: "cuda: NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)".
  virtual std::string describe() const = 0;

  // The gradients and optimizer state it can keep resident (optim/device_state.h), for the
  // trainer; the model itself only runs forward and backward.
  virtual DeviceTrainingState& training_state() = 0;
};

// The CUDA operations for `model` (its config and parameter layout). An Error saying why when
// this build has no CUDA backend or this machine no usable device.
std::unique_ptr<DeviceOps> make_cuda_ops(const Transformer& model);

}  // namespace moetrain
