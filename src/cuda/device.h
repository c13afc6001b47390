// The CUDA runtime seen from the rest of src/cuda: checked calls, device buffers and the one
// stream + cuBLAS handle the device operations run on. Only src/cuda (and tests/cuda) include this
// file.
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
#define MOETRAIN_CUDA_CHECK(expr)                                                                 \
  do {                                                                                            \
    const cudaError_t moetrain_cuda_err_ = (expr);                                                \
    MOETRAIN_CHECK(moetrain_cuda_err_ == cudaSuccess, "CUDA: {} failed: {} ({})", #expr,          \
                   cudaGetErrorString(moetrain_cuda_err_), cudaGetErrorName(moetrain_cuda_err_)); \
  } while (0)
#define MOETRAIN_CUBLAS_CHECK(expr)                                                              \
  do {                                                                                           \
    const cublasStatus_t moetrain_cublas_st_ = (expr);                                           \
    MOETRAIN_CHECK(moetrain_cublas_st_ == CUBLAS_STATUS_SUCCESS, "cuBLAS: {} failed: {}", #expr, \
                   cublasGetStatusString(moetrain_cublas_st_));                                  \
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

// The stream the device operations run on, a cuBLAS handle bound to it, and what its GEMMs take as
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
  // Attention's products in f32 whatever the GEMM mode (cuda/kernels.h, attention).
  bool attention_f32() const { return attention_f32_; }
  void set_attention_f32(bool on) { attention_f32_ = on; }
  // bf16 operands: a bf16 copy of the n floats at `base` (the parameters), kept current by its
  // owner; an operand inside [base, base + n) is read from it rather than rounded again.
  void set_weight_copy(const float* base, int64_t n, const uint16_t* copy) {
    copy_base_ = base, copy_n_ = n, copy_ = copy;
  }
  // The bf16 copy of the n floats at p, if p .. p + n lies inside the weight copy or inside an
  // activation copy of a live Bf16Operand; null otherwise.
  const uint16_t* bf16_copy(const float* p, int64_t n) const {
    if (const uint16_t* c = inside(p, n, copy_base_, copy_n_, copy_)) return c;
    for (const ActivationCopy& a : activations_)
      if (const uint16_t* c = inside(p, n, a.base, a.n, a.buf.data())) return c;
    return nullptr;
  }
  // Scratch for the bf16 rounding of operand i (0 or 1) of the GEMM being queued: n elements.
  uint16_t* scratch(int i, int64_t n) const {
    scratch_[i].resize(n);
    return scratch_[i].data();
  }
  // Scratch of one device call at a time (attention's packed heads and score tiles): at least
  // `bytes`, kept for the next call (grown, never shrunk), contents undefined.
  void* workspace(int64_t bytes) const {
    workspace_.resize(bytes);
    return workspace_.data();
  }
  // The bf16 GEMMs' cuBLASLt handle, workspace and chosen algorithms (cuda/gemm.cpp), made at the
  // first bf16 GEMM.
  std::unique_ptr<GemmPlans, void (*)(GemmPlans*)>& plans() const { return plans_; }

 private:
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  DeviceGemm gemm_mode_ = DeviceGemm::F32;
  bool attention_f32_ = false;
  const float* copy_base_ = nullptr;
  int64_t copy_n_ = 0;
  const uint16_t* copy_ = nullptr;
  mutable DeviceBuffer<uint16_t> scratch_[2];
  mutable DeviceBuffer<unsigned char> workspace_;
  // Slots of Bf16Operand: a source range (null when free) and its copy.
  struct ActivationCopy {
    const float* base = nullptr;
    int64_t n = 0;
    DeviceBuffer<uint16_t> buf;
  };
  static constexpr int kActivationCopies = 4;
  mutable ActivationCopy activations_[kActivationCopies];
  friend class Bf16Operand;

  static const uint16_t* inside(const float* p, int64_t n, const float* base, int64_t len,
                                const uint16_t* copy) {
    return copy && p >= base && p + n <= base + len ? copy + (p - base) : nullptr;
  }
  mutable std::unique_ptr<GemmPlans, void (*)(GemmPlans*)> plans_{nullptr, destroy};
};

// With bf16 GEMMs: an activation that several GEMMs read, rounded to bf16 once, and read from that
// copy by every GEMM queued while the scope lives that takes an operand inside it (instead of
// rounding the operand again for each). The n floats at p must not change while it lives. Does
// nothing in other modes, or when every slot is taken (the GEMMs then round as usual).
class Bf16Operand {
 public:
  // Rounds the n floats at p into the copy now.
  Bf16Operand(const Context& ctx, const float* p, int64_t n);
  // The copy is written by the kernel that produces p's values (into data(), when not null),
  // queued before the first GEMM that reads it.
  struct WrittenByProducer {};
  Bf16Operand(const Context& ctx, const float* p, int64_t n, WrittenByProducer);
  ~Bf16Operand();
  Bf16Operand(const Bf16Operand&) = delete;
  Bf16Operand& operator=(const Bf16Operand&) = delete;
  // The copy; null where none is kept (not bf16, or every slot taken).
  uint16_t* data() const { return slot_ ? slot_->buf.data() : nullptr; }
  // Rounds the floats into the copy (queued now), where one is kept.
  void fill();

 private:
  const Context& ctx_;
  Context::ActivationCopy* slot_ = nullptr;
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
