// The CUDA operations of the Transformer (cuda/ops.h). The parameters live in one device
// allocation with the host layout's offsets; each MoE layer's routing (top-K, capacity, balancing
// losses, statistics) is decided by the model's own MoeLayer on the host from logits computed
// here (ops_moe.cpp), so the GPU and the CPU route alike, and only the (N, E) logits, the layout
// and the (N, S) combine gradients cross the bus. Everything else stays on the device: until
// end_grads adds the gradients into the caller's host buffer, or, resident (the trainer), for
// good: the update step runs on the device gradient and AdamW steps the device parameters and
// moments (ops_state.cpp).
#include "cuda/ops.h"

#include <fmt/format.h>

#include "cuda/gemm.h"
#include "model/transformer.h"

namespace moetrain {
namespace cuda {

CudaOps::CudaOps(const ModelConfig& cfg, int64_t n_params)
    : C_(cfg.dim), theta_(static_cast<float>(cfg.rope_theta)), n_params_(n_params) {
  MOETRAIN_CHECK(cfg.dim % cfg.n_heads == 0 && cfg.n_heads % cfg.n_kv_heads == 0,
                 "cuda: heads do not divide (dim {}, n_heads {}, n_kv_heads {})", cfg.dim,
                 cfg.n_heads, cfg.n_kv_heads);
  params_.resize(n_params_);
  grads_.resize(n_params_);
  grads_host_.resize(static_cast<std::size_t>(n_params_));
  moe_acts_.resize(static_cast<std::size_t>(cfg.n_layers));
  description_ = "cuda: " + cuda::device_description();
}

void* CudaOps::allocate(std::size_t bytes) {
  void* p = nullptr;
  MOETRAIN_CUDA_CHECK(cudaMalloc(&p, bytes));
  MOETRAIN_CUDA_CHECK(cudaMemset(p, 0, bytes));
  return p;
}

void CudaOps::deallocate(void* p) {
  cudaFree(p);
}

const int32_t* CudaOps::ids(Ints& dev, const int32_t* host, int64_t n) {
  DevicePhase ph(ctx_, Phase::Data);
  dev.resize(*this, n);
  if (n > 0)
    MOETRAIN_CUDA_CHECK(cudaMemcpy(dev.data(), host, sizeof(int32_t) * n, cudaMemcpyHostToDevice));
  return dev.data();
}

const float* CudaOps::to_host(std::vector<float>& staging, const float* x, int64_t n) {
  staging.resize(static_cast<std::size_t>(n));
  ctx_.sync();
  if (n > 0)
    MOETRAIN_CUDA_CHECK(cudaMemcpy(staging.data(), x, sizeof(float) * n, cudaMemcpyDeviceToHost));
  return staging.data();
}

void CudaOps::bind_params(const float* params) {
  if (!stale_ && params == uploaded_from_) return;
  DevicePhase ph(ctx_, Phase::Data);
  params_.upload(params, n_params_);
  refresh_weight_copy();
  uploaded_from_ = params;
  stale_ = false;
}

void CudaOps::begin_grads(const float* params, float* grads) {
  MOETRAIN_CHECK(params == uploaded_from_ && !stale_,
                 "backward: the parameters changed since the forward");
  MOETRAIN_CHECK(resident_ || grads, "backward: no gradient buffer");
  // Resident, the step's micro-batches sum here from zero_grads(); else each backward starts at
  // zero and adds its gradients into the caller's buffer at the end.
  if (!resident_)
    MOETRAIN_CUDA_CHECK(
        cudaMemsetAsync(grads_.data(), 0, sizeof(float) * n_params_, ctx_.stream()));
  gradient_.invalidate();
}

void CudaOps::end_grads(float* grads) {
  if (resident_) return;
  // Parameter gradients are +=: this micro-batch's join what the caller holds.
  ctx_.sync();
  grads_.download(grads_host_.data(), n_params_);
  const int64_t n = n_params_;
  const float* g = grads_host_.data();
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) grads[i] += g[i];
}

void CudaOps::linear_forward(float* out, const float* inp, const void*, int64_t w, int64_t N,
                             int64_t IC, int64_t OC, int64_t ld) {
  MOETRAIN_CHECK(ld == 0, "cuda: a weight's column slice (tensor parallelism) is CPU only");
  DevicePhase ph(ctx_, Phase::Gemm);
  cuda::linear_forward(ctx_, out, inp, params_.data() + w, N, IC, OC);
}

void CudaOps::linear_backward_input(float* dinp, bool acc, const float* dout, const void*,
                                    int64_t w, int64_t N, int64_t IC, int64_t OC, int64_t ld) {
  MOETRAIN_CHECK(ld == 0, "cuda: a weight's column slice (tensor parallelism) is CPU only");
  DevicePhase ph(ctx_, Phase::Gemm);
  cuda::gemm(ctx_, Trans::N, Trans::N, N, IC, OC, dout, params_.data() + w, dinp, acc);
}

void CudaOps::linear_backward_weight(float* dweight, const float* dout, const void*,
                                     const float* inp, const void*, int64_t N, int64_t IC,
                                     int64_t OC, int64_t ld) {
  MOETRAIN_CHECK(ld == 0, "cuda: a weight's column slice (tensor parallelism) is CPU only");
  DevicePhase ph(ctx_, Phase::Gemm);
  cuda::gemm(ctx_, Trans::T, Trans::N, OC, IC, N, dout, inp, dweight, true);
}

void CudaOps::embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N,
                                int64_t C, int64_t V) {
  DevicePhase ph(ctx_, Phase::Embedding);
  cuda::embedding_forward(out, ids, table, N, C, V, ctx_.stream());
}

void CudaOps::embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N,
                                 int64_t C, int64_t V) {
  DevicePhase ph(ctx_, Phase::Embedding);
  cuda::embedding_backward(dtable, dout, ids, N, C, V, ctx_.stream());
}

void CudaOps::rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight,
                              int64_t N, int64_t C, float eps) {
  DevicePhase ph(ctx_, Phase::Norm);
  cuda::rmsnorm_forward(out, rstd, inp, weight, N, C, eps, ctx_.stream());
}

void CudaOps::add_rmsnorm_forward(float* out, float* rstd, float* xsum, const float* x,
                                  const float* weight, int64_t N, int64_t C, float eps) {
  DevicePhase ph(ctx_, Phase::Norm);
  cuda::add(xsum, xsum, x, N * C, ctx_.stream());
  cuda::rmsnorm_forward(out, rstd, xsum, weight, N, C, eps, ctx_.stream());
}

void CudaOps::rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                               const float* weight, const float* rstd, int64_t N, int64_t C,
                               const float* dadd) {
  DevicePhase ph(ctx_, Phase::Norm);
  cuda::rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C, ctx_.stream());
  if (dadd) cuda::add(dinp, dinp, dadd, N * C, ctx_.stream());
}

void CudaOps::rope_forward(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                           int64_t HS, int64_t) {
  DevicePhase ph(ctx_, Phase::Rope);
  cuda::rope_forward(out, inp, pos, N, NH, HS, theta_, ctx_.stream());
}

void CudaOps::rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t N,
                            int64_t NH, int64_t HS, int64_t) {
  DevicePhase ph(ctx_, Phase::Rope);
  cuda::rope_backward(dinp, dout, pos, N, NH, HS, theta_, ctx_.stream());
}

void CudaOps::attention_forward(float* out, float* lse, const float* q, const float* k,
                                const float* v, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                int64_t HS) {
  DevicePhase ph(ctx_, Phase::Attention);
  cuda::attention_forward(ctx_, out, lse, q, k, v, B, T, NH, NKV, HS);
}

void CudaOps::attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                 const float* k, const float* v, const float* out, const float* lse,
                                 int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  DevicePhase ph(ctx_, Phase::Attention);
  cuda::attention_backward(ctx_, dq, dk, dv, dout, q, k, v, out, lse, B, T, NH, NKV, HS);
}

void CudaOps::swiglu_forward(float* out, const float* a, const float* b, int64_t n) {
  DevicePhase ph(ctx_, Phase::Activation);
  cuda::swiglu_forward(out, a, b, n, ctx_.stream());
}

void CudaOps::swiglu_backward(float* da, float* db, const float* dout, const float* a,
                              const float* b, int64_t n) {
  DevicePhase ph(ctx_, Phase::Activation);
  cuda::swiglu_backward(da, db, dout, a, b, n, ctx_.stream());
}

void CudaOps::add(float* out, const float* a, const float* b, int64_t n) {
  DevicePhase ph(ctx_, Phase::Norm);  // the residual joins, timed with the norms
  cuda::add(out, a, b, n, ctx_.stream());
}

void CudaOps::softmax_xent_forward(float* losses, float* lse, const float* logits,
                                   const int32_t* targets, int64_t N, int64_t V) {
  DevicePhase ph(ctx_, Phase::Loss);
  cuda::softmax_xent_forward(losses, lse, logits, targets, N, V, ctx_.stream());
}

void CudaOps::softmax_xent_backward(float* dlogits, float dloss, const float* logits,
                                    const float* lse, const int32_t* targets, int64_t N,
                                    int64_t V) {
  DevicePhase ph(ctx_, Phase::Loss);
  dlosses_host_.assign(static_cast<std::size_t>(N), dloss);
  dlosses_.resize(N);
  dlosses_.upload(dlosses_host_.data(), N);
  cuda::softmax_xent_backward(dlogits, dlosses_.data(), logits, lse, targets, N, V, ctx_.stream());
}

}  // namespace cuda

std::unique_ptr<DeviceOps> make_cuda_ops(const Transformer& model) {
  return std::make_unique<cuda::CudaOps>(model.config(), model.layout().size());
}

}  // namespace moetrain
