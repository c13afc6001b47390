// The operations the Transformer's forward and backward are written over (model/transformer.cpp,
// model/transformer_block.cpp): one description of the model, run by an implementation per
// device — CpuOps (model/cpu_ops.h, the kernels of src/kernels on this CPU) and the CUDA
// backend's (src/cuda/ops.h). The model keeps its activations in the implementation's memory
// (OpsArray) and passes every buffer as a pointer into it; each operation has the shapes and
// accumulation rules of the CPU kernel of the same name (src/kernels): parameter gradients +=,
// activation gradients =, unless an argument says otherwise.
//
// Parameters: bind_params makes the caller's flat parameter buffer (model/params.h) the one the
// operations read — a GEMM's weight is named by its layout offset (the implementation keeps the
// low-precision copy of train.precision by offset), every other weight by a pointer from
// params(). Gradients accumulate at grads() between begin_grads and end_grads. Routing stays in
// the model's MoeLayer objects, shared by both devices: the MoE block runs as one operation that
// asks its layer for the decisions.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "model/params.h"
#include "moe/moe_layer.h"

namespace moetrain {

class ModelOps;

// n elements of T in a ModelOps' memory (the host's for the CPU, the device's for CUDA). Resized
// through the operations that own the memory; the contents do not survive a resize that grows.
template <class T>
class OpsArray {
 public:
  OpsArray() = default;
  OpsArray(const OpsArray&) = delete;
  OpsArray& operator=(const OpsArray&) = delete;
  ~OpsArray() { reset(); }
  inline void resize(ModelOps& ops, int64_t n);
  void reset();
  T* data() { return p_; }
  const T* data() const { return p_; }
  int64_t size() const { return n_; }
  int64_t bytes() const { return cap_ * static_cast<int64_t>(sizeof(T)); }

 private:
  ModelOps* owner_ = nullptr;
  T* p_ = nullptr;
  int64_t n_ = 0, cap_ = 0;
};
using Floats = OpsArray<float>;
using Ints = OpsArray<int32_t>;

class ModelOps {
 public:
  virtual ~ModelOps() = default;

  // --- memory ---
  // bytes of zeroed memory; never null for bytes > 0 (throws instead).
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* p) = 0;
  // n ids from the host into `dev` (or the host's own pointer where the memory is the host's).
  virtual const int32_t* ids(Ints& dev, const int32_t* host, int64_t n) = 0;
  // n floats of this memory readable on the host: x itself, or a copy in `staging` (waits for
  // the queued work).
  virtual const float* to_host(std::vector<float>& staging, const float* x, int64_t n) = 0;

  // --- parameters and gradients ---
  // The forward's parameters (the caller's flat buffer): uploaded or rounded where they changed.
  virtual void bind_params(const float* params) = 0;
  virtual const float* params() const = 0;
  // The parameters behind the last pointer changed in place.
  virtual void weights_changed() = 0;
  // Backward's gradients start: grads() is where this backward's parameter gradients accumulate
  // (the caller's `grads`, or the device's gradient); end_grads adds them into `grads` where they
  // are not the caller's own. params: the forward's (a device refuses others: its activations
  // are the forward's).
  virtual void begin_grads(const float* params, float* grads) = 0;
  virtual float* grads() = 0;
  virtual void end_grads(float* grads) = 0;

  // --- the model's operations ---
  // A GEMM operand rounded to the GEMM type where the implementation keeps it rounded (the CPU's
  // bf16 / fp16 precision keeps a copy in `buf` for the weight gradient): null otherwise.
  virtual const void* round(HalfBuffer& buf, const float* x, int64_t n) = 0;
  // out (N, OC) = inp (N, IC) · Wᵀ, W at parameter offset w, rows ld apart (0: IC; a column slice
  // of a wider matrix under tensor parallelism); inp_lp: round(inp).
  virtual void linear_forward(float* out, const float* inp, const void* inp_lp, int64_t w,
                              int64_t N, int64_t IC, int64_t OC, int64_t ld = 0) = 0;
  // dinp (N, IC) = (or += with acc) dout (N, OC) · W; dout_lp: round(dout).
  virtual void linear_backward_input(float* dinp, bool acc, const float* dout, const void* dout_lp,
                                     int64_t w, int64_t N, int64_t IC, int64_t OC,
                                     int64_t ld = 0) = 0;
  // dweight (OC, IC) += doutᵀ · inp.
  virtual void linear_backward_weight(float* dweight, const float* dout, const void* dout_lp,
                                      const float* inp, const void* inp_lp, int64_t N, int64_t IC,
                                      int64_t OC, int64_t ld = 0) = 0;
  virtual void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N,
                                 int64_t C, int64_t V) = 0;
  virtual void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N,
                                  int64_t C, int64_t V) = 0;
  virtual void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight,
                               int64_t N, int64_t C, float eps) = 0;
  // xsum += x, then out = rmsnorm(xsum) (a residual join and the next norm).
  virtual void add_rmsnorm_forward(float* out, float* rstd, float* xsum, const float* x,
                                   const float* weight, int64_t N, int64_t C, float eps) = 0;
  // dinp = ∂/∂inp (+ dadd where not null); dweight +=.
  virtual void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                                const float* weight, const float* rstd, int64_t N, int64_t C,
                                const float* dadd = nullptr) = 0;
  // RoPE over (N, NH, HS) at positions pos, of sequences of T; in place allowed.
  virtual void rope_forward(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                            int64_t HS, int64_t T) = 0;
  virtual void rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t N,
                             int64_t NH, int64_t HS, int64_t T) = 0;
  // Causal grouped-query attention (kernels/attention.h).
  virtual void attention_forward(float* out, float* lse, const float* q, const float* k,
                                 const float* v, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                 int64_t HS) = 0;
  virtual void attention_backward(float* dq, float* dk, float* dv, const float* dout,
                                  const float* q, const float* k, const float* v, const float* out,
                                  const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                  int64_t HS) = 0;
  virtual void swiglu_forward(float* out, const float* a, const float* b, int64_t n) = 0;
  virtual void swiglu_backward(float* da, float* db, const float* dout, const float* a,
                               const float* b, int64_t n) = 0;
  virtual void add(float* out, const float* a, const float* b, int64_t n) = 0;
  virtual void softmax_xent_forward(float* losses, float* lse, const float* logits,
                                    const int32_t* targets, int64_t N, int64_t V) = 0;
  // dlogits = dloss · (softmax − onehot) on rows with a target, 0 elsewhere.
  virtual void softmax_xent_backward(float* dlogits, float dloss, const float* logits,
                                     const float* lse, const int32_t* targets, int64_t N,
                                     int64_t V) = 0;
  // The MoE block of layer l: out (N, C) = moe(inp), routed by `moe` (its decisions, statistics
  // and balancing losses), weights at the block's offsets o. replay: recompute the activations
  // the layer dropped (train.recompute) from the same decisions.
  virtual void moe_forward(MoeLayer& moe, int64_t l, float* out, const float* inp, int64_t N,
                           const MoeBlockOffsets& o, const MoeStep& step, bool replay) = 0;
  // dinp (N, C) = ∂/∂inp of the last forward of layer l; weight gradients +=; the balancing
  // losses' gradients with weight moe_weight.
  virtual void moe_backward(MoeLayer& moe, int64_t l, float* dinp, const float* dout,
                            const MoeBlockOffsets& o, float moe_weight) = 0;
};

template <class T>
void OpsArray<T>::resize(ModelOps& ops, int64_t n) {
  if (&ops != owner_ || n > cap_) {
    reset();
    if (n > 0) p_ = static_cast<T*>(ops.allocate(sizeof(T) * static_cast<std::size_t>(n)));
    owner_ = &ops, cap_ = n;
  }
  n_ = n;
}

template <class T>
void OpsArray<T>::reset() {
  if (p_) owner_->deallocate(p_);
  p_ = nullptr, n_ = cap_ = 0;
}

}  // namespace moetrain
