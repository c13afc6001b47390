// Configuration of one MoE layer, its parameter views and their sizes.
#pragma once
#include <cstdint>
#include <string_view>

#include "core/dtype.h"

namespace moetrain {

enum class RouterKind { TopKSoftmax, NoisyTopK, ExpertChoice, SigmoidBias };

// "topk_softmax" | "noisy_topk" | "expert_choice" | "sigmoid_bias"; anything else is an Error
// that lists the allowed names.
RouterKind parse_router_kind(std::string_view name);
std::string_view router_kind_name(RouterKind kind);
// Token-choice routers give every token K slots; expert choice lets every expert pick tokens.
inline bool is_token_choice(RouterKind kind) {
  return kind != RouterKind::ExpertChoice;
}

// What happens to a token-choice assignment over its expert's capacity (model.overflow): drop
// it, or reroute it to the token's next-best expert that still has room (moe/dispatch.h).
enum class Overflow { Drop, Reroute };
// The load-balancing loss of the token-choice softmax routers (model.balance_loss): Switch's
// E·Σ f_i·P_i or the variance of importance and load (moe/balance.h).
enum class BalanceLoss { Switch, Variance };
const char* overflow_name(Overflow o);
const char* balance_loss_name(BalanceLoss b);
// The routers that have a load-balancing loss (the others are balanced by construction or by
// their bias).
inline bool has_balance_loss(RouterKind kind) {
  return kind == RouterKind::TopKSoftmax || kind == RouterKind::NoisyTopK;
}

struct MoeConfig {
  int64_t C = 0, F = 0, E = 0, K = 2;  // model dim, expert hidden, experts, top-k
  RouterKind router = RouterKind::TopKSoftmax;
  // Token-choice routers: divide the kept weights by their sum. noisy_topk always normalises
  // (its weights are a softmax over the kept logits); expert_choice never does.
  bool renormalize = true;
  // Token choice, Tutel's modes: cf > 0 a per-expert capacity ceil(N·K/E·cf); cf = 0 dropless
  // (every expert computes exactly the rows it got: the grouped GEMM takes groups of any size, so
  // nothing is padded); cf < 0 the capacity min(ceil(N·K/E·|cf|), the largest load any expert
  // needs), that largest load taken over every process of the stats communicator so that they
  // all use one capacity. Expert choice: ceil(N·K/E·cf) tokens per expert, 0 read as 1, < 0 an
  // error.
  float capacity_factor = 0.0f;
  // Token choice with a capacity (cf ≠ 0): drop the assignments over it, or reroute them.
  Overflow overflow = Overflow::Drop;
  BalanceLoss balance_loss = BalanceLoss::Switch;  // weighted by aux_loss_coef
  float aux_loss_coef = 1e-2f, z_loss_coef = 1e-3f;
  float bias_update_rate = 1e-3f;  // sigmoid_bias γ
  int64_t shared_F = 0;            // shared expert hidden size, 0 = none
  // Group-limited routing (token-choice routers): the experts form G contiguous groups; a token
  // keeps its best M groups, ranked by the sum of its top-min(K, E/G) scores in each, and picks
  // its top-K among their experts only. G ≤ 1 = off.
  int64_t route_groups = 0;      // G
  int64_t route_group_topk = 0;  // M
  // A fixed Zipf skew s ≥ 0 on the routing: expert e's logit gets −s·ln(e + 1) (so its share of
  // an otherwise uniform router goes as (e + 1)^−s), the skewed workload of bench_balance in a
  // trained model; the offset is constant, so the backward is unchanged. 0 = off.
  float router_skew = 0.0f;

  bool group_limited() const { return route_groups > 1; }

  // Throws an Error naming the first invalid field, its value and what is allowed.
  void validate() const;
  // The group-limited routing part of validate(), with messages naming the model.* keys.
  void validate_route_groups() const;
  // model.overflow and model.balance_loss against the router and capacity, likewise.
  void validate_overflow_and_balance() const;
};

// Views into the model's flat parameter buffer; the gradient buffer has the same layout, so the
// same struct points at gradients.
struct MoeWeights {
  float* gate = nullptr;   // (E, C)   HF block_sparse_moe.gate.weight
  float* noise = nullptr;  // (E, C)   noisy_topk only
  float* w1 = nullptr;     // (E, F, C) expert j at w1 + j*F*C  (HF experts.{j}.w1.weight is (F, C))
  float* w3 = nullptr;     // (E, F, C)
  float* w2 = nullptr;     // (E, C, F)
  float* shared_w1 = nullptr;  // (Fs, C)
  float* shared_w3 = nullptr;  // (Fs, C)
  float* shared_w2 = nullptr;  // (C, Fs)
  // Mixed precision: the expert weights rounded to `lp` (bf16 or fp16), same shapes, which the
  // expert GEMMs then use with low-precision activations. F32 (the default): the experts compute
  // in f32 and these stay null. The gate has no copy: the router always computes in f32.
  DType lp = DType::F32;
  const void* w1_lp = nullptr;         // (E, F, C)
  const void* w3_lp = nullptr;         // (E, F, C)
  const void* w2_lp = nullptr;         // (E, C, F)
  const void* shared_w1_lp = nullptr;  // (Fs, C)
  const void* shared_w3_lp = nullptr;  // (Fs, C)
  const void* shared_w2_lp = nullptr;  // (C, Fs)
};

// Number of floats behind each MoeWeights field (0 for a field the config does not use).
struct MoeParamSizes {
  int64_t gate = 0, noise = 0, w1 = 0, w3 = 0, w2 = 0, shared_w1 = 0, shared_w3 = 0, shared_w2 = 0;
  int64_t total() const { return gate + noise + w1 + w3 + w2 + shared_w1 + shared_w3 + shared_w2; }
};
MoeParamSizes moe_param_sizes(const MoeConfig& cfg);
// Points the fields of a MoeWeights at consecutive blocks of `base` in the field order above;
// `base` must hold moe_param_sizes(cfg).total() floats. Unused fields stay null.
MoeWeights moe_weights_from_buffer(const MoeConfig& cfg, float* base);

// ceil(N·K/E·cf) clamped to [0, N]: the most assignments one expert may take.
int64_t expert_capacity(int64_t N, int64_t K, int64_t E, float capacity_factor);

// Where a forward sits in training: noise is drawn from (seed, step, layer) and only when training.
struct MoeStep {
  bool training = true;
  uint64_t seed = 0;
  uint64_t step = 0;
  uint64_t layer = 0;
  // Index of this batch's first token in the step's global batch (a data-parallel rank's rows
  // start at rank · B · T). Router noise is drawn per global token, so a run split over
  // processes draws the same noise for a token as the one-process run.
  uint64_t token_offset = 0;
};

}  // namespace moetrain
