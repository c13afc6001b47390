// The CUDA runtime seen from the rest of src/cuda: checked calls, device buffers and the one
// stream + cuBLAS handle an engine runs on. Only src/cuda (and tests/cuda) include this file.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "core/check.h"
#include "core/dtype.h"
#include "core/profile.h"

// Every CUDA runtime and cuBLAS call is checked; the message names the call and the reason.
#define MOETRAIN_CUDA_CHECK(expr)                                                        \
  do {                                                                                   \
    const cudaError_t moetrain_cuda_err_ = (expr);                                       \
    MOETRAIN_CHECK(moetrain_cuda_err_ == cudaSuccess, "CUDA: {} failed: {} ({})", #expr, \
                   cudaGetErrorString(moetrain_cuda_err_),                               \
                   cudaGetErrorName(moetrain_cuda_err_));                                \
  } while (0)
#define MOETRAIN_CUBLAS_CHECK(expr)                                                       \
  do {                                                                                    \
    const cublasStatus_t moetrain_cublas_st_ = (expr);                                    \
    MOETRAIN_CHECK(moetrain_cublas_st_ == CUBLAS_STATUS_SUCCESS, "cuBLAS: {} failed: {}", \
                   #expr, cublasGetStatusString(moetrain_cublas_st_));                    \
  } while (0)
// After a kernel launch: a bad launch configuration is reported here, not at the next sync.
#define MOETRAIN_CUDA_LAUNCHED() MOETRAIN_CUDA_CHECK(cudaGetLastError())

namespace moetrain::cuda {

struct GemmPlans;  // cuda/gemm.cpp: cuBLASLt state of the bf16 GEMMs
void destroy(GemmPlans* p);

// Whether a CUDA device can be used here; if not, *why says what was found instead.
bool device_available(std::string* why = nullptr);
// "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)" for the current device.
std::string device_description();

// n elements of T in device memory (cudaMalloc; never managed memory). resize() keeps the
// allocation when it is large enough and drops the contents otherwise.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(int64_t n) { resize(n); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_), cap_(o.cap_) {
    o.p_ = nullptr, o.n_ = o.cap_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_), std::swap(n_, o.n_), std::swap(cap_, o.cap_);
    return *this;
  }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  void resize(int64_t n) {
    MOETRAIN_CHECK(n >= 0, "DeviceBuffer: size {} is negative", n);
    if (n > cap_) {
      if (p_) MOETRAIN_CUDA_CHECK(cudaFree(p_));
      p_ = nullptr;
      MOETRAIN_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), sizeof(T) * n));
      cap_ = n;
    }
    n_ = n;
  }
  T* data() { return p_; }
  const T* data() const { return p_; }
  int64_t size() const { return n_; }
  // Synchronous copies of the first n elements (n ≤ size()).
  void upload(const T* host, int64_t n) {
    MOETRAIN_CHECK(n <= n_, "DeviceBuffer::upload: {} elements into {}", n, n_);
    if (n > 0) MOETRAIN_CUDA_CHECK(cudaMemcpy(p_, host, sizeof(T) * n, cudaMemcpyHostToDevice));
  }
  void download(T* host, int64_t n) const {
    MOETRAIN_CHECK(n <= n_, "DeviceBuffer::download: {} elements from {}", n, n_);
    if (n > 0) MOETRAIN_CUDA_CHECK(cudaMemcpy(host, p_, sizeof(T) * n, cudaMemcpyDeviceToHost));
  }

 private:
  T* p_ = nullptr;
  int64_t n_ = 0, cap_ = 0;
};

// The stream an engine runs on, a cuBLAS handle bound to it, and what its GEMMs take as
// operands (cuda/gemm.h). Kernels of src/cuda take the stream; GEMMs take the context.
class Context {
 public:
  Context();
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t blas() const { return blas_; }
  void sync() const { MOETRAIN_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  DeviceGemm gemm_mode() const { return gemm_mode_; }
  void set_gemm_mode(DeviceGemm g) { gemm_mode_ = g; }
  // bf16 operands: a bf16 copy of the n floats at `base` (the parameters), kept current by its
  // owner; an operand inside [base, base + n) is read from it rather than rounded again.
  void set_weight_copy(const float* base, int64_t n, const uint16_t* copy) {
    copy_base_ = base, copy_n_ = n, copy_ = copy;
  }
  const uint16_t* weight_copy(const float* p) const {
    return copy_ && p >= copy_base_ && p < copy_base_ + copy_n_ ? copy_ + (p - copy_base_) : nullptr;
  }
  // Scratch for the bf16 rounding of operand i (0 or 1) of the GEMM being queued: n elements.
  uint16_t* scratch(int i, int64_t n) const {
    scratch_[i].resize(n);
    return scratch_[i].data();
  }
  // The bf16 GEMMs' cuBLASLt handle, workspace and chosen algorithms (cuda/gemm.cpp), made at the
  // first bf16 GEMM.
  std::unique_ptr<GemmPlans, void (*)(GemmPlans*)>& plans() const { return plans_; }

 private:
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  DeviceGemm gemm_mode_ = DeviceGemm::F32;
  const float* copy_base_ = nullptr;
  int64_t copy_n_ = 0;
  const uint16_t* copy_ = nullptr;
  mutable DeviceBuffer<uint16_t> scratch_[2];
  mutable std::unique_ptr<GemmPlans, void (*)(GemmPlans*)> plans_{nullptr, destroy};
};

// A phase of the per-phase profile (core/profile.h) around device work: when profiling, the
// stream is drained on entry and on exit, so the host-timed phase is the device's time for it.
// Costs one flag load otherwise.
class DevicePhase {
 public:
  DevicePhase(const Context& ctx, Phase p) : ctx_(ctx), on_(drain(ctx)), scope_(p) {}
  ~DevicePhase() {
    if (on_) ctx_.sync();  // before scope_ closes the phase
  }
  DevicePhase(const DevicePhase&) = delete;
  DevicePhase& operator=(const DevicePhase&) = delete;

 private:
  static bool drain(const Context& ctx) {
    if (!profile::on()) return false;
    ctx.sync();
    return true;
  }
  const Context& ctx_;
  bool on_;
  PhaseScope scope_;
};

// Blocks of `threads` covering n items.
inline unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace moetrain::cuda
