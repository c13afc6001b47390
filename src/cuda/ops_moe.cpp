// The MoE block on the device (cuda/ops.h): the router's GEMMs on the device, its decisions by the
// model's own MoeLayer on the host, the layout copied over, the experts' SwiGLU as one GEMM per
// expert and matrix over its rows, and combine; the backward in reverse.
#include "cuda/ops.h"

#include <algorithm>
#include <optional>

#include "cuda/gemm.h"

namespace moetrain::cuda {

DeviceMoeActs& CudaOps::moe_acts(int64_t l) {
  auto& a = moe_acts_[static_cast<std::size_t>(l)];
  if (!a) a = std::make_unique<DeviceMoeActs>();
  return *a;
}

void CudaOps::expert_forward(const float* xp, float* y, int64_t r0, int64_t rows, const float* w1,
                             const float* w3, const float* w2, int64_t F, float* A, float* Bv,
                             float* G) {
  const int64_t C = C_;
  cuda::linear_forward(ctx_, A + r0 * F, xp + r0 * C, w1, rows, C, F);
  cuda::linear_forward(ctx_, Bv + r0 * F, xp + r0 * C, w3, rows, C, F);
  // With bf16 GEMMs the SwiGLU writes g's bf16 copy for w2's GEMM as well.
  const Bf16Operand g16(ctx_, G + r0 * F, rows * F, Bf16Operand::WrittenByProducer{});
  cuda::swiglu_forward(G + r0 * F, A + r0 * F, Bv + r0 * F, rows * F, ctx_.stream(), g16.data());
  cuda::linear_forward(ctx_, y + r0 * C, G + r0 * F, w2, rows, F, C);
}

void CudaOps::moe_forward(MoeLayer& moe, int64_t l, float* out, const float* inp, int64_t N,
                          const MoeBlockOffsets& o, const MoeStep& step, bool replay) {
  MOETRAIN_CHECK(!replay, "cuda: the MoE block keeps every activation (train.recompute = none)");
  DeviceMoeActs& a = moe_acts(l);
  a.inp = inp, a.N = N;
  const MoeConfig& mc = moe.config();
  const int64_t C = C_, E = mc.E, F = mc.F;
  const float* P = params_.data();
  // Router logits on the device (f32 operands in every mode, as on the CPU), decisions on the host
  // (the model's own MoE layer).
  std::optional<DevicePhase> routing(std::in_place, ctx_, Phase::Router);
  router_logits_.resize(N * E);
  cuda::linear_forward(ctx_, router_logits_.data(), inp, P + o.gate, N, C, E, true);
  float* logits_host = moe.logits_for(N);
  ctx_.sync();
  router_logits_.download(logits_host, N * E);
  if (mc.router == RouterKind::NoisyTopK) {
    cuda::linear_forward(ctx_, router_logits_.data(), inp, P + o.noise, N, C, E, true);
    ctx_.sync();
    router_logits_.download(moe.noise_logits(), N * E);
  }
  const Routing& r = moe.route(N, step);
  build_layout(a.layout, r);
  const DispatchLayout& lay = a.layout;
  const int64_t R = lay.R, S = lay.S;
  a.row_token.resize(R), a.slot_row.resize(N * S), a.row_weight.resize(R);
  a.row_token.upload(lay.row_token.data(), R);
  a.slot_row.upload(lay.slot_row.data(), N * S);
  a.row_weight.upload(lay.row_weight.data(), R);
  routing.reset();
  a.xp.resize(R * C), a.y.resize(R * C);
  a.a.resize(R * F), a.b.resize(R * F), a.ge.resize(R * F);
  {
    DevicePhase ph(ctx_, Phase::Dispatch);
    cuda::permute_forward(a.xp.data(), inp, a.row_token.data(), R, C, ctx_.stream());
  }
  std::optional<DevicePhase> experts(std::in_place, ctx_, Phase::Experts);
  // With bf16 GEMMs each expert's rows feed two GEMMs (w1, w3): rounded once for both.
  std::optional<Bf16Operand> xp16(std::in_place, ctx_, a.xp.data(), R * C);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = lay.counts[e];
    if (rows == 0) continue;
    expert_forward(a.xp.data(), a.y.data(), lay.offsets[e], rows, P + o.w1 + e * F * C,
                   P + o.w3 + e * F * C, P + o.w2 + e * C * F, F, a.a.data(), a.b.data(),
                   a.ge.data());
  }
  xp16.reset();
  const bool shared = mc.shared_F > 0;
  if (shared) {
    const int64_t Fs = mc.shared_F;
    a.sa.resize(N * Fs), a.sb.resize(N * Fs), a.sg.resize(N * Fs);
    const Bf16Operand ln16(ctx_, inp, N * C);
    expert_forward(inp, out, 0, N, P + o.shared_w1, P + o.shared_w3, P + o.shared_w2, Fs,
                   a.sa.data(), a.sb.data(), a.sg.data());
  }
  experts.reset();
  {
    DevicePhase ph(ctx_, Phase::Dispatch);
    cuda::combine_forward(out, a.y.data(), a.slot_row.data(), a.row_weight.data(), N, S, C, shared,
                          ctx_.stream());
  }
  DevicePhase ph(ctx_, Phase::Router);
  moe.finish_route(lay.counts.data());
}

void CudaOps::moe_backward(MoeLayer& moe, int64_t l, float* dinp, const float* dout,
                           const MoeBlockOffsets& o, float moe_weight) {
  DeviceMoeActs& a = moe_acts(l);
  const MoeConfig& mc = moe.config();
  const DispatchLayout& lay = a.layout;
  const float* inp = a.inp;
  const int64_t N = a.N, C = C_, E = mc.E, F = mc.F, R = lay.R, S = lay.S;
  const float* P = params_.data();
  float* G = grads_.data();
  const cudaStream_t s = ctx_.stream();
  // dout is ∂L/∂out. Combine's backward gives the rows' gradients and the router weights'.
  const bool shared = mc.shared_F > 0;
  const int64_t Fs = mc.shared_F;
  // Sized once before any kernel reads them: the shared expert reuses them after the routed ones.
  const int64_t scratch = std::max(R * F, shared ? N * Fs : 0);
  dy_.resize(R * C), dxp_.resize(R * C), dweight_.resize(N * S);
  da_.resize(scratch), db_.resize(scratch), dge_.resize(scratch);
  {
    DevicePhase ph(ctx_, Phase::Dispatch);
    cuda::combine_backward(dy_.data(), dweight_.data(), dout, a.y.data(), a.slot_row.data(),
                           a.row_weight.data(), N, S, C, s);
    dweight_host_.resize(static_cast<std::size_t>(N * S));
    ctx_.sync();
    dweight_.download(dweight_host_.data(), N * S);
  }
  // The experts, each over its own rows: dg = dy·W2; SwiGLU backward; dxp = da·W1 + db·W3;
  // weight gradients +=. With bf16 GEMMs, dy and xp (rounded once for all experts by the caller)
  // and da, db each feed two GEMMs: each is rounded once.
  auto expert_backward = [&](const float* dy, const float* xp, float* dxp, int64_t r0, int64_t rows,
                             int64_t f, const float* A, const float* Bv, const float* Gv, float* dA,
                             float* dB, float* dG, int64_t w1, int64_t w3, int64_t w2, bool acc) {
    cuda::linear_backward(ctx_, dG + r0 * f, false, G + w2, dy + r0 * C, Gv + r0 * f, P + w2, rows,
                          f, C);
    // With bf16 GEMMs the SwiGLU backward writes da and db in bf16 only, for the GEMMs below.
    Bf16Operand da16(ctx_, dA + r0 * f, rows * f, Bf16Operand::WrittenByProducer{}),
        db16(ctx_, dB + r0 * f, rows * f, Bf16Operand::WrittenByProducer{});
    const bool both = da16.data() && db16.data();
    cuda::swiglu_backward(dA + r0 * f, dB + r0 * f, dG + r0 * f, A + r0 * f, Bv + r0 * f, rows * f,
                          s, both ? da16.data() : nullptr, both ? db16.data() : nullptr);
    if (!both) da16.fill(), db16.fill();  // one slot only: it rounds the f32 output
    cuda::linear_backward(ctx_, dxp + r0 * C, acc, G + w1, dA + r0 * f, xp + r0 * C, P + w1, rows,
                          C, f);
    cuda::linear_backward(ctx_, dxp + r0 * C, true, G + w3, dB + r0 * f, xp + r0 * C, P + w3, rows,
                          C, f);
  };
  std::optional<DevicePhase> experts(std::in_place, ctx_, Phase::Experts);
  std::optional<Bf16Operand> dy16(std::in_place, ctx_, dy_.data(), R * C),
      xp16(std::in_place, ctx_, a.xp.data(), R * C);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = lay.counts[e];
    if (rows == 0) continue;
    expert_backward(dy_.data(), a.xp.data(), dxp_.data(), lay.offsets[e], rows, F, a.a.data(),
                    a.b.data(), a.ge.data(), da_.data(), db_.data(), dge_.data(), o.w1 + e * F * C,
                    o.w3 + e * F * C, o.w2 + e * C * F, false);
  }
  dy16.reset(), xp16.reset();
  if (shared) {
    // The shared expert sees every token: its input gradient starts dinp, the routed rows add.
    const Bf16Operand dr16(ctx_, dout, N * C), ln16(ctx_, inp, N * C);
    expert_backward(dout, inp, dinp, 0, N, Fs, a.sa.data(), a.sb.data(), a.sg.data(), da_.data(),
                    db_.data(), dge_.data(), o.shared_w1, o.shared_w3, o.shared_w2, false);
  }
  experts.reset();
  {
    DevicePhase ph(ctx_, Phase::Dispatch);
    cuda::permute_backward(dinp, dxp_.data(), a.slot_row.data(), N, S, C, shared, s);
  }
  // The router: ∂/∂logits on the host (the MoE layer's own rules, with the balancing losses),
  // then its GEMMs here, in f32.
  DevicePhase ph(ctx_, Phase::Router);
  const float* dl = moe.logit_grads(dweight_host_.data(), moe_weight);
  if (dl == nullptr) return;
  drouter_.resize(N * E);
  drouter_.upload(dl, N * E);
  cuda::linear_backward(ctx_, dinp, true, G + o.gate, drouter_.data(), inp, P + o.gate, N, C, E,
                        true);
  if (const float* dnl = moe.noise_logit_grads()) {
    ctx_.sync();  // drouter_ is read by the GEMMs above before it is overwritten
    drouter_.upload(dnl, N * E);
    cuda::linear_backward(ctx_, dinp, true, G + o.noise, drouter_.data(), inp, P + o.noise, N, C, E,
                          true);
  }
}

}  // namespace moetrain::cuda
