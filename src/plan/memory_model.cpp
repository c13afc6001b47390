// The planner's memory model: what one device holds for a run (parameters, gradients, optimizer
// state with and without ZeRO-1, low-precision copies, activations), and the "does not fit" error.
#include <fmt/format.h>

#include "core/check.h"
#include "core/dtype.h"
#include "plan/cost_model.h"

namespace moetrain::plan {

namespace {

double optimizer_state_floats(const std::string& name) {
  return name == "adamw" ? 2 : 1;
}

}  // namespace

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

Memory memory_per_device(const RunConfig& cfg, const Layout& layout, bool accelerator) {
  const ModelConfig& m = cfg.model;
  const ParamCounts pc = count_params(m);
  // Each process keeps its tensor shard of the dense tensors of its stage's layers and E / EP
  // experts of each of them.
  const double tp = static_cast<double>(layout.tp), pp = static_cast<double>(layout.pp);
  const double local = pc.dense / (tp * pp) + pc.expert / static_cast<double>(layout.ep) / pp;
  Memory mem;
  mem.params = 4 * local;
  mem.grads = 4 * local;
  mem.optimizer_without_zero = 4 * optimizer_state_floats(cfg.optim.name) * local;
  // ZeRO-1 shards the state of dense tensors over all processes and of each expert over the
  // DP ranks that hold a replica of it.
  mem.optimizer = cfg.dist.zero == 1
                      ? 4 * optimizer_state_floats(cfg.optim.name) *
                            (pc.dense / (tp * pp * static_cast<double>(layout.stage())) +
                             pc.expert / (pp * static_cast<double>(layout.ep * layout.dp())))
                      : mem.optimizer_without_zero;
  const DType prec = cfg.train.precision_dtype();
  mem.low_precision = prec == DType::F32 ? 0 : static_cast<double>(dtype_size(prec)) * local;
  // Activations kept for backward of one micro-batch (f32 masters of every saved tensor): per
  // layer the norm inputs and rstd, q/k/v, attention output and lse, the residual, router
  // probabilities, dispatched rows, the experts' h1/h3/act and outputs; then the logits.
  const double N = static_cast<double>(cfg.train.batch_size * cfg.train.seq_len);
  const double C = m.dim, HS = m.head_dim(), K = m.top_k, F = m.expert_hidden;
  double per_layer_moe =
      N * (3 * C + 2 + (2 * m.n_heads + 2 * m.n_kv_heads) * HS + 2 * m.n_experts + 2 * K * C +
           3 * K * F + 3 * m.shared_expert_hidden) +
      static_cast<double>(cfg.train.batch_size * m.n_heads * cfg.train.seq_len);
  double per_layer_dense =
      N * (3 * C + 2 + (2 * m.n_heads + 2 * m.n_kv_heads) * HS + 3 * m.dense_ffn_hidden());
  // Pipelining (1F1B) keeps pp micro-batches of L / pp layers on the first stage: the same as one
  // micro-batch of every layer. Tensor parallelism shards them (taken as all of them: approximate).
  // This trainer keeps f32 masters of them; GPU trainers (Megatron, DeepSpeed) keep bf16/fp16
  // ones in a low-precision run.
  const double act_bytes = accelerator && prec != DType::F32 ? static_cast<double>(dtype_size(prec)) : 4.0;
  mem.activations = act_bytes / tp *
                    (static_cast<double>(m.n_moe_layers()) * per_layer_moe +
                     static_cast<double>(m.n_layers - m.n_moe_layers()) * per_layer_dense +
                     N * (2 * C + m.vocab_size));
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
