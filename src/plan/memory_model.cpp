// The planner's memory model: what one device holds for a run (parameters, gradients, optimizer
// state with and without ZeRO-1, low-precision copies, activations), and the "does not fit" error.
#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "core/dtype.h"
#include "plan/cost_model.h"
#include "train/memory_estimate.h"

namespace moetrain::plan {

// From the shapes ParamLayout (model/params.cpp) lays out, tensor by tensor, without building
// its table: a plan of a million experts must not name each one (tests/plan/plan_test.cpp checks
// the two agree on models with every optional tensor).
ParamCounts count_params(const ModelConfig& m) {
  m.validate();
  const double C = static_cast<double>(m.dim), V = static_cast<double>(m.vocab_size);
  const double HS = static_cast<double>(m.head_dim());
  const double L = static_cast<double>(m.n_layers), Lm = static_cast<double>(m.n_moe_layers());
  const double E = static_cast<double>(m.n_experts);
  ParamCounts c;
  // Embedding and LM head (V, C), final norm; per layer two norms, q and o (NH·HS, C), k and v
  // (NKV·HS, C).
  const double attention =
      2 * C + 2 * static_cast<double>(m.n_heads) * HS * C +
      2 * static_cast<double>(m.n_kv_heads) * HS * C;
  c.dense = 2 * V * C + C + L * attention;
  c.dense += (L - Lm) * 3 * static_cast<double>(m.dense_ffn_hidden()) * C;
  // MoE blocks: the router (and its noise projection), the shared expert; the experts' w1, w3
  // (F, C) and w2 (C, F).
  const double router = E * C * (m.router == RouterKind::NoisyTopK ? 2 : 1);
  c.dense += Lm * (router + 3 * static_cast<double>(m.shared_expert_hidden) * C);
  c.expert = Lm * E * 3 * static_cast<double>(m.expert_hidden) * C;
  return c;
}

double activation_bytes(const RunConfig& cfg, bool accelerator) {
  const DType prec = cfg.train.precision_dtype();
  return accelerator && prec != DType::F32 ? static_cast<double>(dtype_size(prec)) : 4.0;
}

int64_t zero_stage(const RunConfig& cfg, const Layout& layout) {
  return layout.zero >= 0 ? layout.zero : cfg.dist.zero;
}

Memory memory_per_device(const RunConfig& cfg, const Layout& layout, bool accelerator) {
  const ModelConfig& m = cfg.model;
  const ParamCounts pc = count_params(m);
  // Each process keeps its tensor shard of the dense tensors of its stage's layers and E / EP
  // experts of each of them. ZeRO shards a dense tensor's state over the stage's data-parallel
  // world (every process holding that shard) and an expert's over the DP ranks that hold a
  // replica of it.
  const double tp = static_cast<double>(layout.tp), pp = static_cast<double>(layout.pp);
  const double dense_local = pc.dense / (tp * pp);
  const double expert_local = pc.expert / static_cast<double>(layout.ep) / pp;
  const DType prec = cfg.train.precision_dtype();
  const int zero = static_cast<int>(zero_stage(cfg, layout));
  // A GPU run in bf16/fp16 keeps state as Megatron and DeepSpeed do (bf16 weights, f32 masters
  // with the optimizer state); this trainer (and a calibrated CPU) keeps f32 weights and a copy.
  auto state = [&](int stage) {
    return accelerator && prec != DType::F32
               ? mixed_precision_state(cfg.optim.name, stage)
               : trainer_state(cfg.optim.name, prec == DType::F32 ? 0 : static_cast<int>(dtype_size(prec)),
                               stage);
  };
  const MemoryEstimate dense =
      state_memory(state(zero), dense_local, static_cast<double>(layout.stage()));
  const MemoryEstimate expert =
      state_memory(state(zero), expert_local, static_cast<double>(layout.dp()));
  Memory mem;
  mem.params = dense.parameters + expert.parameters;
  mem.grads = dense.gradients + expert.gradients;
  mem.optimizer = dense.optimizer + expert.optimizer;
  mem.low_precision = dense.low_precision + expert.low_precision;
  mem.optimizer_without_zero = state_memory(state(0), dense_local + expert_local, 1).optimizer;
  // Activations kept for backward of one micro-batch: per layer the norm inputs and rstd,
  // q/k/v, attention output and lse, the residual, router probabilities, dispatched rows, the
  // experts' h1/h3/act and outputs; then the logits.
  const double N = static_cast<double>(cfg.train.batch_size * cfg.train.seq_len);
  const double C = m.dim, HS = m.head_dim(), K = m.top_k, F = m.expert_hidden;
  double per_layer_moe =
      N * (3 * C + 2 + (2 * m.n_heads + 2 * m.n_kv_heads) * HS + 2 * m.n_experts + 2 * K * C +
           3 * K * F + 3 * m.shared_expert_hidden) +
      static_cast<double>(cfg.train.batch_size * m.n_heads * cfg.train.seq_len);
  double per_layer_dense =
      N * (3 * C + 2 + (2 * m.n_heads + 2 * m.n_kv_heads) * HS + 3 * m.dense_ffn_hidden());
  const double Lm = static_cast<double>(m.n_moe_layers());
  const double Ld = static_cast<double>(m.n_layers) - Lm;
  // Full recomputation keeps each layer's input and, while one layer runs backward, that
  // layer's activations (recomputed): the largest layer's.
  const double layers =
      layout.recompute
          ? static_cast<double>(m.n_layers) * N * C +
                std::max(Lm > 0 ? per_layer_moe : 0.0, Ld > 0 ? per_layer_dense : 0.0)
          : Lm * per_layer_moe + Ld * per_layer_dense;
  // Pipelining (1F1B) keeps pp micro-batches of L / pp layers on the first stage: the same as one
  // micro-batch of every layer. Tensor parallelism shards them (taken as all of them: sequence
  // parallelism). This trainer keeps f32 masters of them; GPU trainers (Megatron, DeepSpeed)
  // keep bf16/fp16 ones in a low-precision run.
  mem.activations = activation_bytes(cfg, accelerator) / tp * (layers + N * (2 * C + m.vocab_size));
  return mem;
}

void check_fits(const Prediction& p, const ClusterSpec& cluster) {
  constexpr double kGiB = 1073741824.0;
  const Memory& m = p.memory;
  MOETRAIN_CHECK(p.fits,
                 "the model does not fit: it needs {:.3f} GiB per device (parameters {:.3f}, "
                 "gradients {:.3f}, optimizer {:.3f}, low-precision copies {:.3f}, activations "
                 "{:.3f}), the device has {:.3f} GiB (device.memory_bytes): {:.3f} GiB too much",
                 m.total() / kGiB, m.params / kGiB, m.grads / kGiB, m.optimizer / kGiB,
                 m.low_precision / kGiB, m.activations / kGiB,
                 cluster.device.memory_bytes / kGiB,
                 (m.total() - cluster.device.memory_bytes) / kGiB);
}

}  // namespace moetrain::plan
