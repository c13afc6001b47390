#include "train/memory_estimate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "core/check.h"
#include "core/dtype.h"
#include "model/activation_bytes.h"
#include "optim/offload_store.h"
#include "parallel/pipeline_schedule.h"

namespace moetrain {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kStepWorkspaceBytes = 6.0 * 1024 * 1024;

std::string gib(double bytes) {
  return fmt::format("{:.2f} GiB", bytes / kGiB);
}

// GiB from 1 GiB up, else MiB.
std::string size_text(double bytes) {
  return bytes >= kGiB ? gib(bytes) : fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024.0));
}

// Per parameter: itself, its gradient, two moments (AdamW); plus its low-precision copy.
MemoryEstimate from_counts(double params, double activation_floats, int precision_bytes) {
  MemoryEstimate e = state_memory(trainer_state("adamw", precision_bytes, 0), params, 1);
  e.activations = 4 * activation_floats;
  return e;
}

double optimizer_slots(const std::string& optimizer) {
  return optimizer == "adamw" ? 2 : 1;
}

double expert_params(const MoeModelConfig& m, double dim) {
  return static_cast<double>(m.n_experts) * 3 * dim * static_cast<double>(m.expert_hidden) +
         dim * static_cast<double>(m.n_experts) +  // router
         3 * dim * static_cast<double>(m.shared_expert_hidden);
}

// Saved per token of an MoE block: norms, residuals and projections (~12 C), each chosen
// expert's gate, up and activation (3 K F), the shared expert's, the router's probabilities.
double moe_token_floats(const MoeModelConfig& m, double dim) {
  return 12 * dim + 3 * static_cast<double>(m.top_k * m.expert_hidden) +
         3 * static_cast<double>(m.shared_expert_hidden) + static_cast<double>(m.n_experts);
}

// The largest sum of two neighbours in `units` (ZeRO-3's forward order): what a gather of each
// unit with the next one prefetched, or a unit's backward beside the reduction of the one after
// it, holds at most.
double neighbour_peak(const std::vector<double>& units) {
  double peak = units.empty() ? 0.0 : units.front();
  for (std::size_t i = 1; i < units.size(); ++i) peak = std::max(peak, units[i - 1] + units[i]);
  return peak;
}

}  // namespace

ParamState trainer_state(const std::string& optimizer, int precision_bytes, int zero) {
  ParamState s;
  s.copy = precision_bytes;
  s.slots = optimizer_slots(optimizer);
  s.zero = zero;
  return s;
}

ParamState mixed_precision_state(const std::string& optimizer, int zero) {
  ParamState s;
  s.weight = 2;
  s.master = 4;
  s.slots = optimizer_slots(optimizer);
  s.zero = zero;
  return s;
}

MemoryEstimate state_memory(const ParamState& s, double params, double ranks) {
  MOETRAIN_CHECK(s.zero >= 0 && s.zero <= 3, "ZeRO stage {}: allowed are 0, 1, 2 and 3", s.zero);
  MOETRAIN_CHECK(ranks >= 1, "ZeRO over {} ranks: must be ≥ 1", ranks);
  auto sharded = [&](int from_stage) { return s.zero >= from_stage ? params / ranks : params; };
  MemoryEstimate e;
  e.parameters = s.weight * sharded(3);
  e.low_precision = s.copy * sharded(3);
  e.gradients = s.grad * sharded(2);
  e.optimizer = (s.master + 4 * s.slots) * sharded(1);
  return e;
}

std::string MemoryEstimate::breakdown() const {
  return fmt::format(
      "parameters {}, gradients {}, optimizer state {}, low-precision copies {}, activations {}, "
      "buffers {}, process baseline {}",
      size_text(parameters), size_text(gradients), size_text(optimizer), size_text(low_precision),
      size_text(activations), size_text(buffers), size_text(baseline));
}

std::string MemoryEstimate::table() const {
  const std::pair<const char*, double> rows[] = {
      {"parameters", parameters},       {"gradients", gradients},
      {"optimizer state", optimizer},   {"low-precision copy", low_precision},
      {"activations", activations},     {"buffers", buffers},
      {"process baseline", baseline},   {"total", total()}};
  std::string out;
  for (const auto& [name, bytes] : rows)
    out += fmt::format("  {:<20} {:>12}  {:>14} bytes\n", name, size_text(bytes),
                       static_cast<int64_t>(bytes));
  return out;
}

std::vector<ParamCounts> unit_params(const ModelConfig& m) {
  m.validate();
  const double C = static_cast<double>(m.dim), V = static_cast<double>(m.vocab_size);
  const double E = static_cast<double>(m.n_experts);
  // Per block two norms and the attention's projections: q and o (NH·HS, C), k and v (NKV·HS, C);
  // or multi-head latent attention's (ModelConfig::attention_params).
  const double attention = 2 * C + static_cast<double>(m.attention_params());
  // A dense block's FFN; an MoE block's router (and its noise projection), shared expert and
  // experts' w1, w3 (F, C) and w2 (C, F).
  const double ffn = 3 * static_cast<double>(m.dense_ffn_hidden()) * C;
  const double router = E * C * (m.router == RouterKind::NoisyTopK ? 2 : 1);
  const double moe = router + 3 * static_cast<double>(m.shared_expert_hidden) * C;
  const double experts = E * 3 * static_cast<double>(m.expert_hidden) * C;
  std::vector<ParamCounts> units;
  units.push_back({V * C, 0});  // the embedding (V, C)
  for (int64_t l = 0; l < m.n_layers; ++l)
    units.push_back(m.is_dense_layer(l) ? ParamCounts{attention + ffn, 0}
                                        : ParamCounts{attention + moe, experts});
  units.push_back({C + V * C, 0});  // the final norm, the LM head (V, C)
  return units;
}

ParamCounts count_params(const ModelConfig& m) {
  ParamCounts c;
  for (const ParamCounts& u : unit_params(m)) c.dense += u.dense, c.expert += u.expert;
  return c;
}

namespace {

// The MoE layers' part of activation_parts for N tokens (one process: no received rows): their
// routing and router scores, routed rows and experts' intermediates as recompute mode r keeps
// them, and under moe and full the shared working buffers.
ActivationBytes moe_parts(const ModelConfig& m, int64_t N, Recompute r, DType lp) {
  const int64_t C = m.dim, E = m.n_experts, K = m.top_k, F = m.expert_hidden;
  const int64_t Fs = m.shared_expert_hidden, Lm = m.n_moe_layers(), R = N * K;
  const int64_t f = 4, h = lp == DType::F32 ? 0 : 2;
  auto inter_of = [&](int64_t rows_in, int64_t hidden) {
    return h == 0 ? f * 3 * rows_in * hidden : (2 * f + h) * rows_in * hidden + h * rows_in * C;
  };
  const int64_t inter = inter_of(R, F) + (Fs > 0 ? inter_of(N, Fs) : 0);
  const int64_t routing = N * K * (4 + 4 + 4) + f * N * E * 2 + f * N +
                          (m.router == RouterKind::NoisyTopK ? f * 2 * N * E : 0);
  const int64_t rows = f * 2 * R * C;
  ActivationBytes a;
  a.blocks = Lm * (routing + (r != Recompute::Full ? rows : 0) + (r == Recompute::None ? inter : 0));
  if (r != Recompute::None && Lm > 0) a.once = inter + (r == Recompute::Full ? rows : 0);
  return a;
}

}  // namespace

ActivationBytes tp_activation_parts(const ModelConfig& m, int64_t B, int64_t T, Recompute r,
                                    DType lp, int64_t tp, bool sequence_parallel) {
  MOETRAIN_CHECK(tp >= 1, "tensor-parallel ranks {}: must be ≥ 1", tp);
  if (tp == 1) return activation_parts(m, B, T, r, lp);
  // The split tensors are those of a model with tp times fewer heads (of the same width), dense
  // FFN hidden units and vocabulary columns (the engine refuses a tp that does not divide them).
  ModelConfig s = m;
  s.head_size = m.head_dim();
  s.n_heads /= tp, s.n_kv_heads /= tp;
  s.dense_hidden = std::max<int64_t>(m.dense_ffn_hidden() / tp, 1);
  s.vocab_size /= tp;
  ActivationBytes a = activation_parts(s, B, T, r, lp);
  // Its MoE layers hold their part for the first rank's share of the tokens, the largest.
  const int64_t N = B * T, Nl = (N + tp - 1) / tp;
  const ActivationBytes all = moe_parts(m, N, r, lp), mine = moe_parts(m, Nl, r, lp);
  a.blocks += mine.blocks - all.blocks;
  a.once += mine.once - all.once;
  if (!sequence_parallel) return a;
  // Sequence parallelism (Transformer::ensure_capacity): of the N rows, N − Nl fewer f32 rows of
  // each block's input (C), its attention's and FFN's outputs (2 C), its two rstd (2) and an MoE
  // layer's second norm output (C; a dense FFN's is gathered), and once of the stream leaving
  // the last block (C) and the final norm's rstd (1).
  const int64_t C = m.dim, gone = 4 * (N - Nl), L = m.n_layers;
  bool any_dense = false;
  for (int64_t l = 0; l < L; ++l) {
    const bool dense = m.is_dense_layer(l);
    any_dense |= dense;
    a.blocks -= gone * C;
    if (r != Recompute::Full) a.blocks -= gone * (2 * C + 2 + (dense ? 0 : C));
  }
  a.once -= gone * (C + 1);
  if (r == Recompute::Full && L > 0) a.once -= gone * (2 * C + 2 + (any_dense ? 0 : C));
  return a;
}

namespace {

// Activation bytes one rank keeps for a micro-batch of N = batch · seq_len tokens: what the model
// holds after a forward (activation_parts, model/activation_bytes.h: the one formula, which
// tests/model/recompute_test.cpp checks against the model's own count), and what this trainer's
// layers keep of their backward between steps.
double rank_activation_bytes(const ModelConfig& m, int64_t batch, int64_t seq_len,
                             const RankLayout& l) {
  const double N = static_cast<double>(batch * seq_len);
  const double C = static_cast<double>(m.dim), V = static_cast<double>(m.vocab_size);
  const double K = static_cast<double>(m.top_k), F = static_cast<double>(m.expert_hidden);
  const double Fs = static_cast<double>(m.shared_expert_hidden);
  const double Fd = static_cast<double>(m.dense_ffn_hidden());
  const double Lm = static_cast<double>(m.n_moe_layers());
  const double Ld = static_cast<double>(m.n_layers) - Lm;
  // This trainer in bf16/fp16 keeps rounded copies of the GEMMs' inputs (where it keeps a copy of
  // the weights); a GPU trainer keeps every activation at l.activation_bytes instead of f32. The
  // expert exchange's received rows are among the buffers (rank_memory), so the layers count as
  // on one process.
  const DType lp = l.state.copy > 0 ? DType::BF16 : DType::F32;
  const bool engine_tp = l.whole_params_under_tp && l.tp > 1;
  const ActivationBytes fwd = engine_tp
                                  ? tp_activation_parts(m, batch, seq_len, l.recompute, lp, l.tp,
                                                        l.sequence_parallel)
                                  : activation_parts(m, batch, seq_len, l.recompute, lp);
  // The engine's tensor parallelism: the MoE layers' tokens and the split tensors' share.
  const double share = engine_tp ? 1 / static_cast<double>(l.tp) : 1.0;
  const double ab = l.activation_bytes;
  double layers = ab / 4 * static_cast<double>(fwd.blocks);
  double once = ab / 4 * static_cast<double>(fwd.once);
  if (l.kept_backward_buffers) {
    // This trainer's layers keep their backward's buffers: per token of an MoE layer the routed
    // rows' gradients (2 K C; the other side of the exchange under expert parallelism is among
    // the buffers) and the experts' intermediates' gradients (3 K F, the shared expert's 3 Fs),
    // of a dense layer its FFN's (3 Fd); once the logits' gradients and the model's backward
    // rows, the d* buffers every block's backward writes (about 22 C a token, measured).
    const double rows = 2 * K * C * share, inter = (3 * K * F + 3 * Fs) * share;
    const double dense = 3 * Fd * share;
    switch (l.recompute) {
      case Recompute::None:
        layers += ab * N * (Lm * (rows + inter) + Ld * dense);
        break;
      case Recompute::Moe:  // the intermediates of one MoE layer at a time
        layers += ab * N * (Lm * rows + Ld * dense);
        once += ab * N * (Lm > 0 ? inter : 0.0);
        break;
      case Recompute::Full:  // those of the one block running backward
        once += ab * N * std::max(Lm > 0 ? rows + inter : 0.0, Ld > 0 ? dense : 0.0);
        break;
    }
    once += ab * N * (V * share + 22 * C);
  }
  // A pipeline stage holds its L / pp layers' activations for each micro-batch in flight.
  if (l.pp > 1)
    layers *= (l.pipe_in_flight > 0 ? l.pipe_in_flight : static_cast<double>(l.pp)) /
              static_cast<double>(l.pp);
  // Expert tensor parallelism: an expert's ETP ranks each keep the rows their peers gathered to
  // them (K C a routed token, etp − 1 times more) for the weight gradients of their columns.
  if (l.etp > 1 && l.recompute != Recompute::Full)
    layers += ab * N * Lm * static_cast<double>(l.etp - 1) * K * C;
  // zero_bubble: stage s keeps the deferred output gradients of at most s + 1 micro-batches (its
  // weight passes run s micro-batches late) of its L / pp blocks, the last stage the head's too;
  // the most, the last stage's: pp micro-batches of L / pp blocks and of the head. With vp > 1
  // stage s runs its weight passes 2s chunk passes late: at most 2pp − 1 chunks of L / (pp·vp)
  // blocks (within L blocks) and pp of the head's, so the same figure bounds it.
  if (l.pp > 1 && l.pipe_split_backward) {
    const ActivationBytes d = deferred_grad_parts(m, batch, seq_len,
                                                  l.state.copy > 0 ? DType::BF16 : DType::F32);
    once += static_cast<double>(d.blocks) +
            static_cast<double>(l.pp) * static_cast<double>(d.once);
  }
  // Megatron's tensor parallelism shards them (taken as all of them: sequence parallelism); the
  // engine's split is in fwd and share above.
  return (layers + once) / (engine_tp ? 1.0 : static_cast<double>(l.tp));
}

}  // namespace

MemoryEstimate rank_memory(const ModelConfig& m, int64_t batch, int64_t seq_len,
                           const RankLayout& l) {
  MOETRAIN_CHECK(l.world >= 1 && l.ep >= 1 && l.etp >= 1 && l.tp >= 1 && l.pp >= 1 &&
                     l.world % (l.tp * l.pp) == 0 && (l.world / l.pp) % (l.ep * l.etp) == 0,
                 "memory layout: {} processes do not split into tp {} × pp {} with ep {} × etp {}",
                 l.world, l.tp, l.pp, l.ep, l.etp);
  const ParamCounts pc = count_params(m);
  const double E = static_cast<double>(std::max<int64_t>(m.n_experts, 1));
  const double tp = static_cast<double>(l.tp), pp = static_cast<double>(l.pp);
  const double ep = static_cast<double>(l.ep), etp = static_cast<double>(l.etp);
  // Each rank owns E / ep experts of each MoE layer, 1 / etp of each (and steps them); spare
  // replica slots hold copies of others' experts, which it computes with but does not step.
  const double dense_local = pc.dense / static_cast<double>(l.dense_split());
  const double dense_tp = l.whole_params_under_tp ? 1.0 : tp;
  const double expert_owned = pc.expert / ep / etp / pp;
  const double slots = l.ep > 1 ? static_cast<double>(l.spare_slots) : 0.0;
  const double expert_held = expert_owned + pc.expert / E * slots / pp;
  const MemoryEstimate dense =
      state_memory(l.state, dense_local, static_cast<double>(l.dense_ranks()));
  const MemoryEstimate expert = state_memory(l.state, expert_owned, static_cast<double>(l.dp()));
  const MemoryEstimate held = state_memory(l.state, expert_held - expert_owned, 1);
  MemoryEstimate e;
  e.optimizer = dense.optimizer + expert.optimizer;
  double unit_cap = 0;  // ZeRO-3: a bucket's bytes are at most the largest unit's gradients
  if (l.whole_buffer) {
    // The flat buffer: every parameter's weight, gradient and copy on every rank.
    const MemoryEstimate all = state_memory(ParamState{l.state.weight, l.state.grad,
                                                       l.state.copy, 0, 0, 0},
                                            pc.dense + pc.expert, 1);
    e.parameters = all.parameters, e.gradients = all.gradients;
    e.low_precision = all.low_precision;
    // A stage's copies (the world without stages) reduce its gradients; a stage of one copy has
    // nothing to reduce or shard over and keeps the whole buffer, as at ZeRO-1.
    if (l.world / l.pp > 1 && l.state.zero >= 2) {
      // Floats of each unit (unit_params) this rank writes gradients of and, at ZeRO-3, gathers:
      // its dense tensors and the experts it holds (the others' are never touched).
      const double held_share = 1 / (ep * etp) + slots / E;
      std::vector<double> unit, outside;
      for (const ParamCounts& u : unit_params(m)) {
        unit.push_back(u.dense / dense_tp + u.expert * held_share);
        // What a gather adds: the unit's elements outside this rank's shard (its own are resident).
        outside.push_back(u.dense / dense_tp * (1 - 1 / static_cast<double>(l.dense_ranks())) +
                          u.expert * held_share * (1 - 1 / static_cast<double>(l.dp())));
      }
      const double largest = *std::max_element(unit.begin(), unit.end());
      const double bucket = std::max(l.bucket_first_bytes, l.bucket_bytes);
      if (l.state.zero == 2) {
        // ZeRO-2 (parallel/zero2_reducer.h) hands each bucket's pages back once it is reduced.
        // The model hands a block's gradients on once its backward has written all of them
        // (grads_ready, model/transformer.cpp), so what stays resident is the unit backward is
        // writing and the bucket the communication thread reduces, which may reach into it:
        // two buckets where a unit is smaller than one.
        e.gradients = std::min(e.gradients, std::max(2 * bucket, l.state.grad * largest + bucket));
      } else {
        // ZeRO-3: buckets end at unit boundaries; resident are the unit backward writes and the
        // one before it being reduced. The weights: this rank's shard of every bucket (state_memory
        // at stage 3) and the rest of the units gathered whole, the one computing and the one
        // prefetched (a release hands back only the pages outside the shard).
        e.gradients = std::min(e.gradients, l.state.grad * neighbour_peak(unit));
        unit_cap = l.state.grad * largest;
        e.parameters = std::min(e.parameters, dense.parameters + expert.parameters +
                                                  l.state.weight * neighbour_peak(outside));
        e.low_precision = dense.low_precision + expert.low_precision;
      }
      // In pipeline stages every micro-batch's backward adds into the stage's gradients, which
      // are reduced once a step, after its last backward (train/pipeline_step.h): the stage's
      // gradients (its dense tensors and its experts) stay resident until then.
      if (l.pp > 1)
        e.gradients = std::min(all.gradients, l.state.grad * (dense_local + expert_held));
    }
  } else {
    e.parameters = dense.parameters + expert.parameters + held.parameters;
    e.gradients = dense.gradients + expert.gradients + held.gradients;
    e.low_precision = dense.low_precision + expert.low_precision + held.low_precision;
  }
  if (l.offload == Offload::HostFile) {
    // The state stays in its file; a step streams it through the store's ring.
    e.optimizer = 0;
    e.buffers += static_cast<double>(
        OffloadStore::ring_bytes(static_cast<int>(std::lround(l.state.slots))));
  }
  e.activations = rank_activation_bytes(m, batch, seq_len, l);
  // This trainer's kernels' and allocator's workspace from the first step on, whatever the
  // batch (measured: 6 MiB on two configs of dim 128 and 256).
  if (l.kept_backward_buffers) e.activations += kStepWorkspaceBytes;
  if (l.world / l.pp > 1 && l.whole_buffer) {
    // This trainer's gradient reduction (parallel/grad_sync.h): the reduced shard of every bucket
    // (this rank's share of the dense gradients and of its experts'), one bucket packed for the
    // wire and as much again inside MPI (its nonblocking reduction's temporary; measured).
    e.buffers += l.state.grad * (dense_local / static_cast<double>(l.dense_ranks()) +
                                 expert_owned / static_cast<double>(l.dp()));
    double packed = std::min(std::max(l.bucket_first_bytes, l.bucket_bytes),
                             l.state.grad * (dense_local + expert_owned));
    if (unit_cap > 0) packed = std::min(packed, unit_cap);  // ZeRO-3's buckets end with units
    e.buffers += 2 * packed;
  }
  if (l.ep > 1 && l.whole_buffer) {
    // The expert exchange's rows in flight on both sides (parallel/mpi_exchange.h), each way:
    // about 4 K C floats a token per MoE layer at an even load (measured); a tensor-parallel rank
    // routes 1/tp of its batch's tokens.
    e.buffers += 4 * static_cast<double>(m.top_k * m.dim) *
                 static_cast<double>(batch * seq_len * m.n_moe_layers()) * l.activation_bytes / tp;
  }
  e.baseline = l.baseline;
  return e;
}

RankLayout trainer_layout(const RunConfig& cfg, int64_t world, double baseline) {
  RankLayout l;
  l.world = world;
  // Pipeline stages (a dist.pp that does not divide the processes, or a dist.ep that does not
  // divide a stage's, is refused by name where the process groups are made; the estimate takes
  // neither then): each rank steps its stage's parameters and holds its activation slots, the
  // first stage the most (1F1B: pp micro-batches of its layers; GPipe: every one; interleaved:
  // its schedule's count).
  const bool stages_fit = cfg.dist.pp > 1 && world % cfg.dist.pp == 0;
  const int64_t stage_world = stages_fit ? world / cfg.dist.pp : world;
  l.ep = world > 1 && stage_world % cfg.dist.ep == 0 ? cfg.dist.ep : 1;
  if (stages_fit) {
    l.pp = cfg.dist.pp;
    const PipeSchedule schedule = parse_pipe_schedule(cfg.dist.pp_schedule, "dist.pp_schedule");
    const PipeShape shape{cfg.dist.pp, cfg.train.grad_accum, cfg.dist.vp};
    l.pipe_split_backward = schedule == PipeSchedule::ZeroBubble;
    if (schedule == PipeSchedule::GPipe) {
      l.pipe_in_flight = static_cast<double>(cfg.train.grad_accum);
    } else if ((schedule == PipeSchedule::Interleaved ||
                (schedule == PipeSchedule::ZeroBubble && cfg.dist.vp > 1)) &&
               pipe_shape_problem(schedule, shape).empty()) {
      // The first stage's chunks in flight at most (until their backward, or their weight pass
      // under zero_bubble), in micro-batches' worth of its layers (each chunk a vp-th of them).
      l.pipe_in_flight = simulate(schedule, shape, {}).peak_in_flight[0];
    }
  }
  // Tensor parallelism (a dist.tp that does not divide the processes is refused where the groups
  // are made): the engine's, whole parameters on every rank.
  if (world % cfg.dist.tp == 0) l.tp = cfg.dist.tp;
  l.whole_params_under_tp = true;
  l.sequence_parallel = cfg.dist.sequence_parallel && l.tp > 1;
  l.spare_slots = cfg.placement.spare_slots;
  const DType prec = cfg.train.precision_dtype();
  l.state = trainer_state(cfg.optim.name, prec == DType::F32 ? 0 : static_cast<int>(dtype_size(prec)),
                          static_cast<int>(cfg.dist.zero));
  l.recompute = cfg.train.recompute;
  l.offload = cfg.dist.offloaded() ? Offload::HostFile : Offload::None;
  l.bucket_first_bytes = cfg.dist.bucket_first_mb * 1024 * 1024;
  l.bucket_bytes = cfg.dist.bucket_mb * 1024 * 1024;
  l.baseline = baseline;
  return l;
}

MemoryEstimate estimate_memory(const ModelConfig& m, int64_t batch, int64_t seq_len,
                               int precision_bytes) {
  RankLayout l;
  l.state = trainer_state("adamw", precision_bytes, 0);
  return rank_memory(m, batch, seq_len, l);
}

MemoryEstimate estimate_memory(const ClassifierConfig& m, int64_t batch) {
  const double C = static_cast<double>(m.dim), L = static_cast<double>(m.n_layers);
  const double D = static_cast<double>(m.input_dim), V = static_cast<double>(m.n_classes);
  const double params = D * C + C + L * (C + expert_params(m, C)) + C * V;
  const double per_row = D + 2 * V + L * moe_token_floats(m, C);
  return from_counts(params, static_cast<double>(batch) * per_row, 0);
}

MemoryEstimate estimate_inference_memory(const ModelConfig& m, int64_t batch, int64_t seq_len) {
  RankLayout l;
  l.state = trainer_state("adamw", 0, 0);
  l.kept_backward_buffers = false;  // forward only
  MemoryEstimate e = rank_memory(m, batch, seq_len, l);
  e.gradients = e.optimizer = 0;
  return e;
}

void check_memory(const MemoryEstimate& e, int processes, const std::string& what,
                  const std::string& remedy) {
  std::string source;
  bool own_group = false;
  const double avail = available_memory(&source, &own_group);
  if (avail < 0) return;  // nothing to compare with
  // A memory cgroup of this process alone limits this rank only; otherwise the ranks on this
  // machine share what is available.
  const int here = own_group ? 1 : std::max(processes, 1);
  if (own_group && processes > 1) source += ", this rank's own";
  const double need = e.total() * static_cast<double>(here);
  MOETRAIN_CHECK(need <= avail,
                 "{} needs about {} of memory per rank ({}){}, more than the {} available ({}{}): "
                 "{}",
                 what, gib(e.total()), e.breakdown(),
                 here > 1 ? fmt::format(", {} for the {} ranks on this machine", gib(need), here)
                          : "",
                 gib(avail), source,
                 here > 1 ? fmt::format(", {} per rank", gib(avail / here)) : "",
                 !remedy.empty() ? remedy
                                 : "make the model (model.n_layers, model.dim, model.n_experts, "
                                   "model.expert_hidden) or the batch (train.batch_size, "
                                   "train.seq_len) smaller, or spread the experts over more "
                                   "ranks (dist.ep) and shard the optimizer state (dist.zero)");
}

}  // namespace moetrain
