#include "cuda/device.h"

#include <fmt/format.h>

#include "cuda/kernels.h"

namespace moetrain::cuda {

bool device_available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (why)
      *why = e != cudaSuccess ? fmt::format("no usable CUDA device: {} ({})", cudaGetErrorString(e),
                                            cudaGetErrorName(e))
                              : "no CUDA device";
    cudaGetLastError();  // clear the sticky error of the failed query
    return false;
  }
  return true;
}

std::string device_description() {
  int dev = 0;
  MOETRAIN_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  MOETRAIN_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  return fmt::format("{} (sm_{}{}, {:.1f} GiB)", p.name, p.major, p.minor,
                     static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
}

Context::Context() {
  std::string why;
  MOETRAIN_CHECK(device_available(&why), "train.device = \"cuda\": {}", why);
  // A blocking stream: the synchronous copies of DeviceBuffer (on the legacy default stream) wait
  // for the kernels queued here, and the kernels queued after them wait for the copies.
  MOETRAIN_CUDA_CHECK(cudaStreamCreate(&stream_));
  MOETRAIN_CUBLAS_CHECK(cublasCreate(&blas_));
  MOETRAIN_CUBLAS_CHECK(cublasSetStream(blas_, stream_));
  // True f32 GEMMs unless a caller asks for TF32: the CPU comparison holds to f32 rounding.
  MOETRAIN_CUBLAS_CHECK(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH));
}

Context::~Context() {
  if (blas_) cublasDestroy(blas_);
  if (stream_) cudaStreamDestroy(stream_);
}

Bf16Operand::Bf16Operand(const Context& ctx, const float* p, int64_t n, WrittenByProducer)
    : ctx_(ctx) {
  if (ctx.gemm_mode() != DeviceGemm::BF16 || n <= 0) return;
  for (Context::ActivationCopy& a : ctx.activations_) {
    if (a.base) continue;
    // Whatever writes the copy is queued on the stream before the GEMMs that read it; a slot's
    // earlier copy is overwritten only after the GEMMs queued before it (stream order).
    a.buf.resize(n);
    a.base = p, a.n = n;
    slot_ = &a;
    return;
  }
}

Bf16Operand::Bf16Operand(const Context& ctx, const float* p, int64_t n)
    : Bf16Operand(ctx, p, n, WrittenByProducer{}) {
  fill();
}

void Bf16Operand::fill() {
  if (slot_) to_bf16(slot_->buf.data(), slot_->base, slot_->n, ctx_.stream());
}

Bf16Operand::~Bf16Operand() {
  if (slot_) slot_->base = nullptr, slot_->n = 0;
}

}  // namespace moetrain::cuda
