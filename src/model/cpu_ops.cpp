#include "model/cpu_ops.h"

#include <cstdlib>
#include <new>

#include "kernels/activation.h"
#include "kernels/attention.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"
#include "kernels/norm.h"
#include "kernels/softmax.h"

namespace moetrain {

void* CpuOps::allocate(std::size_t bytes) {
  void* p = std::calloc(bytes, 1);
  if (!p) throw std::bad_alloc();
  return p;
}

void CpuOps::deallocate(void* p) {
  std::free(p);
}

const void* CpuOps::round(HalfBuffer& buf, const float* x, int64_t n) {
  if (lp_ == DType::F32) return nullptr;
  void* p = buf.ensure(n);
  f32_to_dtype(lp_, p, x, static_cast<std::size_t>(n));
  return p;
}

void CpuOps::linear_forward(float* out, const float* inp, const void* inp_lp, int64_t w, int64_t N,
                            int64_t IC, int64_t OC, int64_t ld) {
  if (lp_ != DType::F32) {
    gemm(lp_, Trans::N, Trans::T, N, OC, IC, inp_lp, weight_lp(w), out, false, 0, ld);
  } else if (ld != 0) {
    gemm(Trans::N, Trans::T, N, OC, IC, inp, params_ + w, out, false, 0, ld);
  } else {
    moetrain::linear_forward(out, inp, params_ + w, N, IC, OC);
  }
}

void CpuOps::linear_backward_input(float* dinp, bool acc, const float* dout, const void* dout_lp,
                                   int64_t w, int64_t N, int64_t IC, int64_t OC, int64_t ld) {
  if (lp_ == DType::F32) {
    gemm(Trans::N, Trans::N, N, IC, OC, dout, params_ + w, dinp, acc, 0, ld);
  } else {
    gemm(lp_, Trans::N, Trans::N, N, IC, OC, dout_lp, weight_lp(w), dinp, acc, 0, ld);
  }
}

void CpuOps::linear_backward_weight(float* dweight, const float* dout, const void* dout_lp,
                                    const float* inp, const void* inp_lp, int64_t N, int64_t IC,
                                    int64_t OC, int64_t ld) {
  if (lp_ == DType::F32) {
    gemm(Trans::T, Trans::N, OC, IC, N, dout, inp, dweight, true, 0, 0, ld);
  } else {
    gemm(lp_, Trans::T, Trans::N, OC, IC, N, dout_lp, inp_lp, dweight, true, 0, 0, ld);
  }
}

void CpuOps::embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N,
                               int64_t C, int64_t V) {
  moetrain::embedding_forward(out, ids, table, N, C, V);
}

void CpuOps::embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N,
                                int64_t C, int64_t V) {
  moetrain::embedding_backward(dtable, dout, ids, N, C, V);
}

void CpuOps::rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight,
                             int64_t N, int64_t C, float eps) {
  moetrain::rmsnorm_forward(out, rstd, inp, weight, N, C, eps);
}

void CpuOps::add_rmsnorm_forward(float* out, float* rstd, float* xsum, const float* x,
                                 const float* weight, int64_t N, int64_t C, float eps) {
  moetrain::add_rmsnorm_forward(out, rstd, xsum, x, weight, N, C, eps);
}

void CpuOps::rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                              const float* weight, const float* rstd, int64_t N, int64_t C,
                              const float* dadd) {
  moetrain::rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C, dadd);
}

const RopeTable& CpuOps::rope_table(int64_t T, int64_t HS) {
  if (!rope_ || rope_->max_pos() < T || rope_->head_size() != HS)
    rope_ = std::make_unique<RopeTable>(T, HS, theta_);
  return *rope_;
}

void CpuOps::rope_forward(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                          int64_t HS, int64_t T) {
  moetrain::rope_forward(out, inp, pos, N, NH, HS, rope_table(T, HS));
}

void CpuOps::rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t N,
                           int64_t NH, int64_t HS, int64_t T) {
  moetrain::rope_backward(dinp, dout, pos, N, NH, HS, rope_table(T, HS));
}

void CpuOps::attention_forward(float* out, float* lse, const float* q, const float* k,
                               const float* v, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                               int64_t HS) {
  const bool bf16 = lp_ == DType::BF16 && attention_bf16_pays(T, HS);
  (bf16 ? attention_forward_bf16 : moetrain::attention_forward)(out, lse, q, k, v, B, T, NH, NKV,
                                                                HS);
}

void CpuOps::attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                const float* k, const float* v, const float* out, const float* lse,
                                int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  const bool bf16 = lp_ == DType::BF16 && attention_bf16_pays(T, HS);
  (bf16 ? attention_backward_bf16 : moetrain::attention_backward)(dq, dk, dv, dout, q, k, v, out,
                                                                  lse, B, T, NH, NKV, HS);
}

void CpuOps::swiglu_forward(float* out, const float* a, const float* b, int64_t n) {
  moetrain::swiglu_forward(out, a, b, n);
}

void CpuOps::swiglu_backward(float* da, float* db, const float* dout, const float* a,
                             const float* b, int64_t n) {
  moetrain::swiglu_backward(da, db, dout, a, b, n);
}

void CpuOps::add(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void CpuOps::softmax_xent_forward(float* losses, float* lse, const float* logits,
                                  const int32_t* targets, int64_t N, int64_t V) {
  moetrain::softmax_xent_forward(losses, lse, logits, targets, N, V);
}

void CpuOps::softmax_xent_backward(float* dlogits, float dloss, const float* logits,
                                   const float* lse, const int32_t* targets, int64_t N, int64_t V) {
  const std::vector<float> dlosses(static_cast<std::size_t>(N), dloss);
  moetrain::softmax_xent_backward(dlogits, dlosses.data(), logits, lse, targets, N, V);
}

void CpuOps::moe_forward(MoeLayer& moe, int64_t, float* out, const float* inp, int64_t N,
                         const MoeBlockOffsets& o, const MoeStep& step, bool replay) {
  // MoeWeights carries mutable views; the forward only reads them.
  const MoeWeights w = moe_weights(const_cast<float*>(params_), o, lp_, params_lp_.data());
  if (replay) {
    moe.recompute_forward(out, inp, w);
  } else {
    moe.forward(out, inp, N, w, step);
  }
}

void CpuOps::moe_backward(MoeLayer& moe, int64_t, float* dinp, const float* dout,
                          const MoeBlockOffsets& o, float moe_weight) {
  moe.backward(dinp, dout, moe_weights(const_cast<float*>(params_), o, lp_, params_lp_.data()),
               moe_weights(grads_, o), moe_weight);
}

}  // namespace moetrain
