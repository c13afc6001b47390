// The planner's memory model: what one device holds for a run (parameters, gradients, optimizer
// state with and without ZeRO-1, low-precision copies, activations), and the "does not fit" error.
#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "core/dtype.h"
#include "model/activation_bytes.h"
#include "plan/cost_model.h"

namespace moetrain::plan {

double activation_bytes(const RunConfig& cfg, bool accelerator) {
  const DType prec = cfg.train.precision_dtype();
  return accelerator && prec != DType::F32 ? static_cast<double>(dtype_size(prec)) : 4.0;
}

int64_t zero_stage(const RunConfig& cfg, const Layout& layout) {
  return layout.zero >= 0 ? layout.zero : cfg.dist.zero;
}

Recompute recompute_mode(const RunConfig& cfg, const Layout& layout) {
  return layout.recompute.value_or(cfg.train.recompute);
}

RankLayout rank_layout(const RunConfig& cfg, const Layout& layout, bool accelerator) {
  RankLayout l = trainer_layout(cfg, layout.procs, 0);
  l.ep = layout.ep;
  l.etp = layout.etp;
  l.tp = layout.tp, l.pp = layout.pp;
  if (layout.pp > 1) {
    // The first stage's micro-batches in flight under the layout's schedule (equal passes; the
    // shape is one layout_problem accepts).
    const PipeShape shape{layout.pp, cfg.train.grad_accum, layout.vp};
    l.pipe_in_flight = simulate(layout.pipe_schedule(), shape, {}).peak_in_flight[0];
    l.pipe_split_backward = layout.pipe_schedule() == PipeSchedule::ZeroBubble;
  }
  const DType prec = cfg.train.precision_dtype();
  const int zero = static_cast<int>(zero_stage(cfg, layout));
  // A GPU run in bf16/fp16 keeps state as Megatron and DeepSpeed do (bf16 weights, f32 masters
  // with the optimizer state), its own experts only and no backward buffers between layers; this
  // trainer (and a calibrated CPU) keeps f32 weights and a copy in its flat buffer of every
  // expert.
  if (accelerator) {
    if (prec != DType::F32) l.state = mixed_precision_state(cfg.optim.name, zero);
    l.whole_buffer = false;
    l.kept_backward_buffers = false;
    l.whole_params_under_tp = false;  // Megatron's tensor parallelism
  }
  l.state.zero = zero;
  l.recompute = recompute_mode(cfg, layout);
  if (layout.offload) l.offload = *layout.offload ? Offload::HostFile : Offload::None;
  l.activation_bytes = activation_bytes(cfg, accelerator);
  return l;
}

namespace {

// The bytes selective recomputation (Layout::recompute_modules) does not keep: the model's count
// (activation_parts) without and with the modules, scaled as rank_memory scales what the blocks
// keep (train/memory_estimate.cpp, rank_activation_bytes): activation_bytes an element for the
// count's f32, the micro-batches the first pipeline stage holds of its L / pp blocks, the tensor
// shard.
double selective_saving(const RunConfig& cfg, const Layout& layout, const RankLayout& l) {
  if (!layout.recompute_modules.any()) return 0;
  const DType lp = l.state.copy > 0 ? DType::BF16 : DType::F32;
  const int64_t B = cfg.train.batch_size, T = cfg.train.seq_len;
  const ActivationBytes all = activation_parts(cfg.model, B, T, l.recompute, lp);
  const ActivationBytes kept =
      activation_parts(cfg.model, B, T, l.recompute, lp, 1, layout.recompute_modules);
  double blocks = l.activation_bytes / 4 * static_cast<double>(all.blocks - kept.blocks);
  const double once = l.activation_bytes / 4 * static_cast<double>(all.once - kept.once);
  if (l.pp > 1)
    blocks *= (l.pipe_in_flight > 0 ? l.pipe_in_flight : static_cast<double>(l.pp)) /
              static_cast<double>(l.pp);
  return (blocks + once) / static_cast<double>(l.tp);
}

}  // namespace

Memory memory_per_device(const RunConfig& cfg, const Layout& layout, bool accelerator) {
  // Each process keeps its tensor shard of the dense tensors of its stage's layers and E / EP
  // experts of each of them (this trainer: every expert's weights and gradients in its flat
  // buffer). ZeRO shards a dense tensor's state over the stage's data-parallel world (every
  // process holding that shard) and an expert's over the DP ranks that hold a replica of it.
  // Pipelining keeps the micro-batches its schedule has in flight of L / pp layers on the first
  // stage: under 1F1B pp of them, the same activations as one micro-batch of every layer; under
  // GPipe every micro-batch of the step.
  const RankLayout l = rank_layout(cfg, layout, accelerator);
  const MemoryEstimate e = rank_memory(cfg.model, cfg.train.batch_size, cfg.train.seq_len, l);
  Memory mem;
  mem.params = e.parameters;
  mem.grads = e.gradients;
  mem.optimizer = e.optimizer;
  mem.low_precision = e.low_precision;
  mem.activations = e.activations - selective_saving(cfg, layout, l);
  mem.buffers = e.buffers;
  RankLayout plain = l;
  plain.state.zero = 0;
  mem.optimizer_without_zero =
      rank_memory(cfg.model, cfg.train.batch_size, cfg.train.seq_len, plain).optimizer;
  return mem;
}

void check_fits(const Prediction& p, const ClusterSpec& cluster) {
  constexpr double kGiB = 1073741824.0;
  const Memory& m = p.memory;
  MOETRAIN_CHECK(p.fits,
                 "the model does not fit: it needs {:.3f} GiB per device (parameters {:.3f}, "
                 "gradients {:.3f}, optimizer {:.3f}, low-precision copies {:.3f}, activations "
                 "{:.3f}, buffers {:.3f}), the device has {:.3f} GiB (device.memory_bytes): "
                 "{:.3f} GiB too much",
                 m.total() / kGiB, m.params / kGiB, m.grads / kGiB, m.optimizer / kGiB,
                 m.low_precision / kGiB, m.activations / kGiB, m.buffers / kGiB,
                 cluster.device.memory_bytes / kGiB,
                 (m.total() - cluster.device.memory_bytes) / kGiB);
}

}  // namespace moetrain::plan
