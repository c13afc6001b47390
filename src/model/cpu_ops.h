// The Transformer's operations on this CPU (model/model_ops.h): the kernels of src/kernels, the
// MoE block through the model's own MoeLayer, host memory. Mixed precision (train.precision bf16
// / fp16) lives here: every GEMM takes its operands rounded to that type — the activations'
// copies the model keeps (round) and the parameters' copy (weight_copy, filled by the model as
// its parameters or its gathered units change) — and accumulates in f32; in bf16 on a CPU with
// AVX512_BF16 the attention core's products take bf16 operands too where that pays
// (attention_bf16_pays).
#pragma once
#include <memory>

#include "core/dtype.h"
#include "kernels/rope.h"
#include "model/model_ops.h"

namespace moetrain {

class CpuOps final : public ModelOps {
 public:
  explicit CpuOps(float rope_theta) : theta_(rope_theta) {}

  // The GEMMs' operand type (F32: nothing rounded) and the parameters' copy in it, at the
  // layout's offsets (2-byte elements).
  void set_precision(DType t) { lp_ = t; }
  DType precision() const { return lp_; }
  HalfBuffer& weight_copy() { return params_lp_; }
  const void* weight_lp(int64_t offset) const {
    return static_cast<const char*>(params_lp_.data()) + offset * 2;
  }

  void* allocate(std::size_t bytes) override;
  void deallocate(void* p) override;
  const int32_t* ids(Ints&, const int32_t* host, int64_t) override { return host; }
  const float* to_host(std::vector<float>&, const float* x, int64_t) override { return x; }

  void bind_params(const float* params) override { params_ = params; }
  const float* params() const override { return params_; }
  void weights_changed() override {}
  void begin_grads(const float* params, float* grads) override { params_ = params, grads_ = grads; }
  float* grads() override { return grads_; }
  void end_grads(float*) override {}

  const void* round(HalfBuffer& buf, const float* x, int64_t n) override;
  void linear_forward(float* out, const float* inp, const void* inp_lp, int64_t w, int64_t N,
                      int64_t IC, int64_t OC, int64_t ld) override;
  void linear_backward_input(float* dinp, bool acc, const float* dout, const void* dout_lp,
                             int64_t w, int64_t N, int64_t IC, int64_t OC, int64_t ld) override;
  void linear_backward_weight(float* dweight, const float* dout, const void* dout_lp,
                              const float* inp, const void* inp_lp, int64_t N, int64_t IC,
                              int64_t OC, int64_t ld) override;
  void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                         int64_t V) override;
  void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N,
                          int64_t C, int64_t V) override;
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                       int64_t C, float eps) override;
  void add_rmsnorm_forward(float* out, float* rstd, float* xsum, const float* x,
                           const float* weight, int64_t N, int64_t C, float eps) override;
  void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                        const float* weight, const float* rstd, int64_t N, int64_t C,
                        const float* dadd) override;
  void rope_forward(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                    int64_t HS, int64_t T) override;
  void rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t N, int64_t NH,
                     int64_t HS, int64_t T) override;
  void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                         int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) override;
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                          const float* k, const float* v, const float* out, const float* lse,
                          int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) override;
  void swiglu_forward(float* out, const float* a, const float* b, int64_t n) override;
  void swiglu_backward(float* da, float* db, const float* dout, const float* a, const float* b,
                       int64_t n) override;
  void add(float* out, const float* a, const float* b, int64_t n) override;
  void softmax_xent_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                            int64_t N, int64_t V) override;
  void softmax_xent_backward(float* dlogits, float dloss, const float* logits, const float* lse,
                             const int32_t* targets, int64_t N, int64_t V) override;
  void moe_forward(MoeLayer& moe, int64_t l, float* out, const float* inp, int64_t N,
                   const MoeBlockOffsets& o, const MoeStep& step, bool replay) override;
  void moe_backward(MoeLayer& moe, int64_t l, float* dinp, const float* dout,
                    const MoeBlockOffsets& o, float moe_weight) override;

 private:
  const RopeTable& rope_table(int64_t T, int64_t HS);

  float theta_;
  DType lp_ = DType::F32;
  HalfBuffer params_lp_;
  const float* params_ = nullptr;
  float* grads_ = nullptr;
  // cos/sin of positions [0, T) for RoPE, built when T first exceeds what it holds.
  std::unique_ptr<RopeTable> rope_;
};

}  // namespace moetrain
