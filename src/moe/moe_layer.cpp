#include "moe/moe_layer.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/timer.h"
#include "moe/balance.h"
#include "moe/dispatch.h"
#include "moe/slot_routing.h"

namespace moetrain {

namespace {
// The most assignments the router gave one expert (before dropping).
int64_t largest_load(const Routing& r) {
  std::vector<int64_t> load(r.E, 0);
  for (int32_t e : r.selected)
    if (e >= 0) ++load[e];
  return load.empty() ? 0 : *std::max_element(load.begin(), load.end());
}
const MoeConfig& validated(const MoeConfig& cfg) {
  cfg.validate();
  return cfg;
}
}  // namespace

MoeLayer::MoeLayer(const MoeConfig& cfg, const MoeContext& ctx)
    : cfg_(validated(cfg)),
      cf_(cfg_.capacity_factor),
      own_exchange_(ctx.exchange ? nullptr : std::make_unique<LocalExchange>()),
      own_stats_(ctx.stats ? nullptr : make_local_comm("moe_stats")),
      stats_comm_(ctx.stats ? *ctx.stats : *own_stats_),
      pipeline_(cfg_, ctx.exchange ? *ctx.exchange : *own_exchange_, ctx.etp) {
  bias_.assign(cfg_.E, 0.0f);
  pending_load_.assign(cfg_.E, 0);
  frac_.assign(cfg_.E, 0.0f);
  stats_.tokens_per_expert.assign(cfg_.E, 0);
}

void MoeLayer::forward(float* out, const float* inp, int64_t N, const MoeWeights& w,
                       const MoeStep& step) {
  const int64_t C = cfg_.C;
  MOETRAIN_CHECK(N >= 0, "MoeLayer::forward: N is {}, must be >= 0", N);
  MOETRAIN_CHECK(N == 0 || (out && inp), "MoeLayer::forward: null out or inp for N={}", N);
  MOETRAIN_CHECK(w.gate && w.w1 && w.w3 && w.w2,
                 "MoeLayer::forward: gate, w1, w3 and w2 must all be set");
  MOETRAIN_CHECK(cfg_.router != RouterKind::NoisyTopK || w.noise,
                 "MoeLayer::forward: noisy_topk needs w.noise");
  MOETRAIN_CHECK(cfg_.shared_F == 0 || (w.shared_w1 && w.shared_w3 && w.shared_w2),
                 "MoeLayer::forward: shared_F={} needs shared_w1, shared_w3 and shared_w2",
                 cfg_.shared_F);
  begin_forward(N, inp);
  {
    ScopedTimer timer(timings_.router);
    router_forward(routing_, router_cache_, inp, N, cfg_, w.gate, w.noise, bias_.data(), step);
  }
  after_routing(step);
  if (placement_) {
    ScopedTimer timer(timings_.permute);
    route_to_slots(slot_routing_, routing_, *placement_);
  }
  pipeline_.send(inp, placement_ ? slot_routing_ : routing_, timings_);
  if (cfg_.shared_F > 0) {
    ScopedTimer timer(timings_.shared);
    experts_forward(out, inp, &N_, shared_expert_range(w), C, cfg_.shared_F, shared_acts());
  }
  pipeline_.compute(w, timings_);
  pipeline_.combine(out, cfg_.shared_F > 0, timings_);

  pipeline_.routed_counts(stats_.tokens_per_expert.data(), &stats_.unrouted_tokens);
  finish_stats();
  if (recompute_ != Recompute::None && !scratch_) shared_acts_.release();
  if (recompute_ == Recompute::Full) pipeline_.release();
  needs_replay_ = recompute_ == Recompute::Full;
}

void MoeLayer::set_recompute(Recompute r, RecomputeScratch* scratch) {
  recompute_ = r;
  scratch_ = r == Recompute::None ? nullptr : scratch;
  pipeline_.set_recompute(r, scratch_);
  needs_replay_ = false;
  has_forward_ = false;
}

void MoeLayer::recompute_forward(float* out, const float* inp, const MoeWeights& w) {
  MOETRAIN_CHECK(has_forward_ && needs_replay_,
                 "MoeLayer::recompute_forward: needs a forward under recompute = full first");
  MOETRAIN_CHECK(N_ == 0 || (out && inp), "MoeLayer::recompute_forward: null out or inp");
  inp_ = inp;
  MoeTimings again;  // the forward's figures stay the forward's
  pipeline_.replay_send(inp, again);
  if (cfg_.shared_F > 0)
    experts_forward(out, inp, &N_, shared_expert_range(w), cfg_.C, cfg_.shared_F, shared_acts());
  pipeline_.compute(w, again);
  pipeline_.combine(out, cfg_.shared_F > 0, again);
  needs_replay_ = false;
}

int64_t MoeLayer::held_bytes() const {
  auto vec = [](const auto& v) {
    return static_cast<int64_t>(v.capacity() * sizeof(v[0]));
  };
  const RouterCache& c = router_cache_;
  int64_t n = vec(routing_.selected) + vec(routing_.expert) + vec(routing_.weight) +
              vec(slot_routing_.selected) + vec(slot_routing_.expert) + vec(slot_routing_.weight);
  n += vec(c.logits) + vec(c.noise_logits) + vec(c.eps) + vec(c.probs) + vec(c.lse) +
       vec(c.dlogits) + vec(c.dnoise_logits);
  n += vec(selection_keys_) + vec(dweight_) + vec(dprobs_) + vec(dz_);
  n += shared_acts_.forward_bytes() + shared_acts_.scratch_bytes() + shared_y_.bytes();
  return n + pipeline_.held_bytes();
}

void MoeLayer::begin_forward(int64_t N, const float* inp) {
  timings_ = MoeTimings{};
  has_forward_ = false;  // until this forward completes
  N_ = N;
  inp_ = inp;
  stats_.capacity = 0;
  stats_.dropped = 0;
  stats_.rerouted = 0;
}

void MoeLayer::after_routing(const MoeStep& step) {
  const int64_t N = N_, E = cfg_.E, K = cfg_.K;
  {
    ScopedTimer timer(timings_.router);
    stats_.capacity_factor = cf_;
    stats_.needed = largest_load(routing_);
    if (is_token_choice(cfg_.router) && cf_ > 0.0f) {
      stats_.capacity = expert_capacity(N, K, E, cf_);
      stats_.dropped = apply_capacity(routing_, stats_.capacity);
      reroute();
    } else if (is_token_choice(cfg_.router) && cf_ < 0.0f) {
      // Max over processes of the bound and of the need: every process gets the same capacity.
      int64_t agreed[2] = {expert_capacity(N, K, E, -cf_), stats_.needed};
      stats_comm_.allreduce(agreed, 2, {.op = ReduceOp::Max});
      stats_.needed = agreed[1];
      stats_.capacity = std::min(agreed[0], agreed[1]);
      stats_.dropped = apply_capacity(routing_, stats_.capacity);
      reroute();
    } else if (cfg_.router == RouterKind::ExpertChoice) {
      float cf = cfg_.capacity_factor > 0.0f ? cfg_.capacity_factor : 1.0f;
      stats_.capacity = expert_capacity(N, K, E, cf);
    }
  }
  {
    // Collective over stats_comm_: the exchange is idle here, every layer drains it before
    // returning.
    ScopedTimer timer(timings_.losses);
    const int64_t S = routing_.S;
    aux_loss_ = 0.0f;
    std::fill(frac_.begin(), frac_.end(), 0.0f);
    if (has_balance_loss(cfg_.router) && cfg_.balance_loss == BalanceLoss::Variance) {
      aux_loss_ = static_cast<float>(
          variance_loss_forward(frac_.data(), router_cache_.probs.data(), N, E, &stats_comm_));
    } else if (has_balance_loss(cfg_.router)) {
      aux_loss_ =
          static_cast<float>(aux_loss_forward(frac_.data(), router_cache_.probs.data(),
                                              routing_.selected.data(), N, E, S, K, &stats_comm_));
    }
    z_loss_ = static_cast<float>(z_loss_forward(router_cache_.lse.data(), N, &stats_comm_));
    if (cfg_.router == RouterKind::SigmoidBias && step.training) {
      for (int64_t i = 0; i < N * S; ++i) ++pending_load_[routing_.selected[i]];
    }
  }
}

void MoeLayer::reroute() {
  if (cfg_.overflow != Overflow::Reroute || stats_.dropped == 0) return;
  selection_keys_.resize(N_ * cfg_.E);
  router_selection_keys(selection_keys_.data(), router_cache_, N_, cfg_, bias_.data());
  const bool normalize = cfg_.router == RouterKind::NoisyTopK || cfg_.renormalize;
  stats_.rerouted = reroute_overflow(routing_, stats_.capacity, selection_keys_.data(),
                                     router_cache_.probs.data(), normalize);
  stats_.dropped -= stats_.rerouted;
}

float* MoeLayer::logits_for(int64_t N) {
  MOETRAIN_CHECK(N >= 0, "MoeLayer::logits_for: N is {}, must be >= 0", N);
  MOETRAIN_CHECK(placement_ == nullptr,
                 "MoeLayer: an engine that computes the layer itself runs without replicas");
  router_logits_resize(router_cache_, N, cfg_);
  return router_cache_.logits.data();
}

const Routing& MoeLayer::route(int64_t N, const MoeStep& step) {
  MOETRAIN_CHECK(router_cache_.N == N, "MoeLayer::route: logits_for({}) first, not {}", N,
                 router_cache_.N);
  begin_forward(N, nullptr);
  {
    ScopedTimer timer(timings_.router);
    router_select(routing_, router_cache_, N, cfg_, bias_.data(), step);
  }
  after_routing(step);
  return routing_;
}

void MoeLayer::finish_route(const int64_t* counts) {
  std::copy_n(counts, cfg_.E, stats_.tokens_per_expert.begin());
  stats_.unrouted_tokens = 0;
  for (int64_t t = 0; t < N_; ++t) {
    bool any = false;
    for (int64_t s = 0; s < routing_.S; ++s) any |= routing_.expert[t * routing_.S + s] >= 0;
    stats_.unrouted_tokens += !any;
  }
  finish_stats();
}

void MoeLayer::finish_stats() {
  stats_.assignments = 0;
  for (int32_t e : routing_.selected) stats_.assignments += e >= 0;
  stats_.fraction_dropped = stats_.assignments > 0 ? static_cast<double>(stats_.dropped) /
                                                         static_cast<double>(stats_.assignments)
                                                   : 0.0;
  has_forward_ = true;
}

void MoeLayer::backward(float* dinp, const float* dout, const MoeWeights& w, const MoeWeights& g,
                        float loss_weight) {
  MOETRAIN_CHECK(has_forward_, "MoeLayer::backward called without a completed forward");
  const int64_t N = N_, C = cfg_.C;
  MOETRAIN_CHECK(N == 0 || (dinp && dout), "MoeLayer::backward: null dinp or dout for N={}", N);
  MOETRAIN_CHECK(g.gate && g.w1 && g.w3 && g.w2,
                 "MoeLayer::backward: gradients of gate, w1, w3 and w2 must be set");
  MOETRAIN_CHECK(!router_cache_.noisy || g.noise,
                 "MoeLayer::backward: noisy_topk in training needs g.noise");
  MOETRAIN_CHECK(cfg_.shared_F == 0 || (g.shared_w1 && g.shared_w3 && g.shared_w2),
                 "MoeLayer::backward: shared_F={} needs the shared expert gradients",
                 cfg_.shared_F);
  dweight_.resize(N * routing_.S);
  pipeline_.send_backward(dweight_.data(), dout, timings_);
  MOETRAIN_CHECK(!needs_replay_,
                 "MoeLayer::backward: recompute = full needs recompute_forward first");
  if (cfg_.shared_F > 0 && N > 0 && recompute_ == Recompute::Moe)
    experts_forward(shared_y().ensure(N * C), inp_, &N_, shared_expert_range(w), C, cfg_.shared_F,
                    shared_acts());
  if (cfg_.shared_F > 0 && N > 0) {
    ScopedTimer timer(timings_.shared);
    experts_backward(dinp, shared_expert_range(g), dout, inp_, &N_, shared_expert_range(w), C,
                     cfg_.shared_F, shared_acts());
  }
  pipeline_.compute_backward(w, g, timings_);
  pipeline_.combine_backward(dinp, cfg_.shared_F > 0, timings_);
  if (recompute_ != Recompute::None && !scratch_) shared_acts_.release(), shared_y_.release();
  if (recompute_ == Recompute::Full) pipeline_.release();
  if (N == 0) return;
  const RouterGrads grads = router_grads(dweight_.data(), loss_weight);
  {
    ScopedTimer timer(timings_.router);
    router_backward(dinp, g.gate, g.noise, grads, inp_, w.gate, w.noise, routing_, router_cache_,
                    cfg_);
  }
}

RouterGrads MoeLayer::router_grads(const float* dweight, float loss_weight) {
  const int64_t N = N_, E = cfg_.E;
  RouterGrads grads;
  grads.dweight = dweight;
  ScopedTimer timer(timings_.losses);
  const float aux_scale = cfg_.aux_loss_coef * loss_weight;
  if (has_balance_loss(cfg_.router) && aux_scale != 0.0f) {
    dprobs_.resize(N * E);
    // Global f_i (or ∂L_var/∂P_i), local token count: this process's share of the gradient.
    if (cfg_.balance_loss == BalanceLoss::Variance) {
      variance_loss_backward(dprobs_.data(), frac_.data(), N, E, aux_scale);
    } else {
      aux_loss_backward(dprobs_.data(), frac_.data(), N, E, aux_scale);
    }
    grads.dprobs = dprobs_.data();
  }
  const float z_scale = cfg_.z_loss_coef * loss_weight;
  if (z_scale != 0.0f) {
    dz_.resize(N * E);
    z_loss_backward(dz_.data(), router_cache_.logits.data(), router_cache_.lse.data(), N, E,
                    z_scale);
    grads.dlogits = dz_.data();
  }
  return grads;
}

const float* MoeLayer::logit_grads(const float* dweight, float loss_weight) {
  MOETRAIN_CHECK(has_forward_, "MoeLayer::logit_grads called without a completed route");
  if (N_ == 0) return nullptr;
  const RouterGrads grads = router_grads(dweight, loss_weight);
  ScopedTimer timer(timings_.router);
  router_logit_grads(grads, routing_, router_cache_, cfg_);
  return router_cache_.dlogits.data();
}

void MoeLayer::set_capacity_factor(float cf) {
  MOETRAIN_CHECK(is_token_choice(cfg_.router),
                 "set_capacity_factor: router {} sets its capacity from model.capacity_factor only",
                 router_kind_name(cfg_.router));
  MOETRAIN_CHECK(std::isfinite(cf), "set_capacity_factor: capacity factor {} is not finite", cf);
  cf_ = cf;
}

void MoeLayer::set_placement(const Placement* p) {
  pipeline_.set_placement(p);
  placement_ = p;
}

void MoeLayer::apply_bias_update(const int64_t* global_load) {
  MOETRAIN_CHECK(cfg_.router == RouterKind::SigmoidBias,
                 "apply_bias_update: router is {}, only sigmoid_bias has a bias",
                 router_kind_name(cfg_.router));
  MOETRAIN_CHECK(global_load != nullptr, "apply_bias_update: null load");
  bias_update(bias_.data(), global_load, cfg_.E, cfg_.bias_update_rate);
  std::fill(pending_load_.begin(), pending_load_.end(), 0);
}

void MoeLayer::take_pending_load(MoeLayer& from) {
  MOETRAIN_CHECK(from.pending_load_.size() == pending_load_.size(),
                 "take_pending_load: {} experts into {}", from.pending_load_.size(),
                 pending_load_.size());
  for (std::size_t e = 0; e < pending_load_.size(); ++e) pending_load_[e] += from.pending_load_[e];
  std::fill(from.pending_load_.begin(), from.pending_load_.end(), 0);
}

void MoeLayer::apply_bias_delta(const double* delta) {
  MOETRAIN_CHECK(cfg_.router == RouterKind::SigmoidBias,
                 "apply_bias_delta: router is {}, only sigmoid_bias has a bias",
                 router_kind_name(cfg_.router));
  MOETRAIN_CHECK(delta != nullptr, "apply_bias_delta: null delta");
  for (int64_t e = 0; e < cfg_.E; ++e)
    bias_[e] += static_cast<float>(cfg_.bias_update_rate * delta[e]);
  std::fill(pending_load_.begin(), pending_load_.end(), 0);
}

}  // namespace moetrain
