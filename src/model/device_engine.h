// A device engine: runs a Transformer's forward and backward somewhere other than this CPU (the
// CUDA backend, src/cuda), behind the Transformer's own interface. The caller keeps the host
// parameter and gradient buffers, so the update step, checkpoints and metrics are the CPU path's:
// the engine uploads the parameters when they change and adds its gradients into the host
// buffer. Routing stays in the model's MoeLayer objects (the same decisions, statistics and
// balancing losses as on the CPU).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "model/transformer.h"

namespace moetrain {

class DeviceTrainingState;  // optim/device_state.h

class DeviceEngine {
 public:
  virtual ~DeviceEngine() = default;
  // As Transformer::forward / backward (same arguments, same results to rounding).
  virtual LossParts forward(const float* params, const int32_t* inputs, const int32_t* targets,
                            int64_t B, int64_t T, const MoeStep& step) = 0;
  virtual void backward(const float* params, float* grads, float loss_weight) = 0;
  // The parameters behind the last pointer changed in place: upload them at the next forward
  // (not resident; a resident engine's parameters change through upload_state).
  virtual void weights_changed() = 0;
  // (B·T, V) logits of the last forward, copied to the host.
  virtual const float* logits() = 0;
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

// The CUDA engine for `model` (its config, layout and MoE layers). An Error saying why when this
// build has no CUDA backend or this machine no usable device.
std::unique_ptr<DeviceEngine> make_cuda_engine(Transformer& model);

}  // namespace moetrain
