// The CUDA operations' resident training state (optim/device_state.h): the gradient the update step
// reads, AdamW over the device parameters and moments, and their copies to and from the host.
#include "cuda/ops.h"

#include "optim/adamw_scalars.h"

namespace moetrain::cuda {

namespace {
// n floats between the host and the device, synchronously.
void copy_floats(void* dst, const void* src, int64_t n, cudaMemcpyKind kind) {
  if (n > 0) MOETRAIN_CUDA_CHECK(cudaMemcpy(dst, src, sizeof(float) * n, kind));
}
}  // namespace

void CudaOps::set_gemm(DeviceGemm g) {
  ctx_.set_gemm_mode(g);
  if (g == DeviceGemm::BF16) {
    params_bf16_.resize(n_params_);
    ctx_.set_weight_copy(params_.data(), n_params_, params_bf16_.data());
    refresh_weight_copy();
  } else {
    ctx_.set_weight_copy(nullptr, 0, nullptr);
  }
}

void CudaOps::refresh_weight_copy() {
  if (ctx_.gemm_mode() == DeviceGemm::BF16)
    cuda::to_bf16(params_bf16_.data(), params_.data(), n_params_, ctx_.stream());
}

void CudaOps::set_resident(bool on) {
  resident_ = on;
  if (on && exp_avg_.size() != n_params_) {
    exp_avg_.resize(n_params_), exp_avg_sq_.resize(n_params_);
    MOETRAIN_CUDA_CHECK(cudaMemset(exp_avg_.data(), 0, sizeof(float) * n_params_));
    MOETRAIN_CUDA_CHECK(cudaMemset(exp_avg_sq_.data(), 0, sizeof(float) * n_params_));
  }
}

void CudaOps::zero_grads() {
  DevicePhase phase(ctx_, Phase::GradZero);
  MOETRAIN_CUDA_CHECK(cudaMemsetAsync(grads_.data(), 0, sizeof(float) * n_params_, ctx_.stream()));
  gradient_.invalidate();
}

GradientShard& CudaOps::gradient() {
  gradient_.invalidate();
  return gradient_;
}

void CudaOps::adamw_step(const OptimizerConfig& c, std::span<const ParamRange> groups, float lr,
                         int64_t t) {
  MOETRAIN_CHECK(resident_, "adamw_step: no optimizer state is kept on the device (not resident)");
  MOETRAIN_CHECK(c.kind == OptimizerKind::AdamW,
                 "train.device = cuda steps with AdamW only, "
                 "not {}",
                 optimizer_kind_name(c.kind));
  const AdamWScalars a = adamw_scalars(c.beta1, c.beta2, c.eps, c.weight_decay, lr, t);
  DevicePhase phase(ctx_, Phase::Optimizer);
  // bf16 GEMMs: the same pass writes the updated parameters' bf16 copy.
  uint16_t* copy = ctx_.gemm_mode() == DeviceGemm::BF16 ? params_bf16_.data() : nullptr;
  for (const ParamRange& g : groups) {
    MOETRAIN_CHECK(g.offset >= 0 && g.size >= 0 && g.offset + g.size <= n_params_,
                   "adamw_step: group [{}, {}) outside the {} parameters", g.offset,
                   g.offset + g.size, n_params_);
    cuda::adamw_step(params_.data() + g.offset, exp_avg_.data() + g.offset,
                     exp_avg_sq_.data() + g.offset, grads_.data() + g.offset, g.size,
                     g.weight_decay && c.weight_decay != 0.0, a, ctx_.stream(),
                     copy ? copy + g.offset : nullptr);
  }
}

void CudaOps::download_state(float* params, float* exp_avg, float* exp_avg_sq, int64_t offset,
                             int64_t n) {
  check_range(offset, n);
  ctx_.sync();
  params_.download(params, n_params_);
  copy_floats(exp_avg, exp_avg_.data() + offset, n, cudaMemcpyDeviceToHost);
  copy_floats(exp_avg_sq, exp_avg_sq_.data() + offset, n, cudaMemcpyDeviceToHost);
}

void CudaOps::upload_state(const float* params, const float* exp_avg, const float* exp_avg_sq,
                           int64_t offset, int64_t n) {
  check_range(offset, n);
  ctx_.sync();
  params_.upload(params, n_params_);
  refresh_weight_copy();
  uploaded_from_ = params;
  stale_ = false;
  copy_floats(exp_avg_.data() + offset, exp_avg, n, cudaMemcpyHostToDevice);
  copy_floats(exp_avg_sq_.data() + offset, exp_avg_sq, n, cudaMemcpyHostToDevice);
}

void CudaOps::check_range(int64_t offset, int64_t n) const {
  MOETRAIN_CHECK(resident_, "cuda: no optimizer state is kept (not resident)");
  MOETRAIN_CHECK(offset >= 0 && n >= 0 && offset + n <= n_params_,
                 "optimizer state [{}, {}) outside the {} parameters", offset, offset + n,
                 n_params_);
}

}  // namespace moetrain::cuda
