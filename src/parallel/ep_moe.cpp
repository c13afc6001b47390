#include "parallel/ep_moe.h"

#include <algorithm>

#include "core/check.h"
#include "core/timer.h"
#include "moe/balance.h"

namespace moetrain {

namespace {
bool has_aux_loss(RouterKind kind) {
  return kind == RouterKind::TopKSoftmax || kind == RouterKind::NoisyTopK;
}
constexpr int64_t kTokenBlock = 256;  // fixed blocks for token sums: thread-count independent

// Tokens [t0, t0 + n) of r.
void slice_routing(Routing& out, const Routing& r, int64_t t0, int64_t n) {
  const int64_t S = r.S;
  out.N = n, out.E = r.E, out.S = S;
  out.selected.assign(r.selected.begin() + t0 * S, r.selected.begin() + (t0 + n) * S);
  out.expert.assign(r.expert.begin() + t0 * S, r.expert.begin() + (t0 + n) * S);
  out.weight.assign(r.weight.begin() + t0 * S, r.weight.begin() + (t0 + n) * S);
}
}  // namespace

ExpertParallelMoe::ExpertParallelMoe(const MoeConfig& cfg, const A2aRoute& route, Comm& stats,
                                     const EpOptions& opts)
    : cfg_(cfg), route_(route), a2a_(*route.group), stats_comm_(stats), opts_(opts) {
  cfg_.validate();
  MOETRAIN_CHECK(
      cfg_.E % a2a_.size() == 0,
      "expert parallelism over {} ranks needs a multiple of {} experts, the model has {}",
      a2a_.size(), a2a_.size(), cfg_.E);
  MOETRAIN_CHECK(opts_.chunks >= 1, "all-to-all chunks = {}: must be at least 1", opts_.chunks);
  MOETRAIN_CHECK(opts_.a2a_dtype == DType::F32 || opts_.a2a_dtype == DType::BF16,
                 "all-to-all payloads in {}: allowed are f32 and bf16",
                 dtype_name(opts_.a2a_dtype));
  E_local_ = cfg_.E / a2a_.size();
  first_ = a2a_.rank() * E_local_;
  bias_.assign(cfg_.E, 0.0f);
  pending_load_.assign(cfg_.E, 0);
  frac_.assign(cfg_.E, 0.0f);
  stats_.tokens_per_expert.assign(cfg_.E, 0);
  chunks_.resize(static_cast<std::size_t>(opts_.chunks));
  for (Chunk& k : chunks_) k.acts.resize(static_cast<std::size_t>(a2a_.size()));
}

int64_t ExpertParallelMoe::received_rows() const {
  int64_t n = 0;
  for (const Chunk& k : chunks_) n += k.plan.R_recv;
  return n;
}

CommThread::Ticket ExpertParallelMoe::communicate(std::function<void()> task) {
  auto timed = [this, task = std::move(task)] {
    ScopedTimer timer(a2a_busy_);
    task();
  };
  if (opts_.thread) return opts_.thread->post(std::move(timed));
  ScopedTimer timer(timings_.a2a_wait);
  timed();
  return 0;
}

void ExpertParallelMoe::wait(CommThread::Ticket t) {
  if (!opts_.thread) return;
  ScopedTimer timer(timings_.a2a_wait);
  opts_.thread->wait(t);
}

void ExpertParallelMoe::balance_losses(int64_t N) {
  const int64_t E = cfg_.E, S = routing_.S, K = cfg_.K;
  z_loss_ = static_cast<float>(z_loss_forward(router_cache_.lse.data(), N));
  aux_loss_ = 0.0f;
  std::fill(frac_.begin(), frac_.end(), 0.0f);
  if (!has_aux_loss(cfg_.router)) return;
  // (E) selections before dropping, then N; (E) Σ_t p[t, e]. Summed over every process.
  std::vector<int64_t> counts(E + 1, 0);
  for (int64_t i = 0; i < N * S; ++i)
    if (routing_.selected[i] >= 0) ++counts[routing_.selected[i]];
  counts[E] = N;
  std::vector<double> psum(E, 0.0), partial(E);
  const float* probs = router_cache_.probs.data();
  for (int64_t b = 0; b < N; b += kTokenBlock) {
    std::fill(partial.begin(), partial.end(), 0.0);
    for (int64_t t = b; t < std::min(N, b + kTokenBlock); ++t)
      for (int64_t e = 0; e < E; ++e) partial[e] += probs[t * E + e];
    for (int64_t e = 0; e < E; ++e) psum[e] += partial[e];
  }
  stats_comm_.allreduce(counts.data(), E + 1);
  stats_comm_.allreduce(psum.data(), E);
  const int64_t Ng = counts[E];
  if (Ng == 0) return;
  double loss = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    const double fe = static_cast<double>(counts[e]) / static_cast<double>(Ng * K);
    frac_[e] = static_cast<float>(fe);
    loss += fe * (psum[e] / static_cast<double>(Ng));
  }
  aux_loss_ = static_cast<float>(static_cast<double>(E) * loss);
}

// The chunk's rows through this rank's experts, one grouped pass per source rank's block.
void ExpertParallelMoe::experts(Chunk& k, const MoeWeights& w, bool forward, const MoeWeights* g) {
  ScopedTimer timer(timings_.experts);
  const int64_t C = cfg_.C;
  const bool local = a2a_.size() == 1;
  const ExpertRange range = expert_range(w, cfg_, first_, E_local_);
  const A2aLayout& plan = k.plan;
  if (forward) {
    const float* xr = local ? k.xp.data() : k.xr.data();
    float* yr = local ? k.y.ensure(k.layout.R * C) : k.yr.ensure(plan.R_recv * C);
    for (int q = 0; q < plan.P; ++q) {
      const int64_t at = plan.recv_offset[q] * C;
      experts_forward(yr + at, xr + at, plan.recv_counts.data() + q * E_local_, range, C, cfg_.F,
                      k.acts[q]);
    }
    return;
  }
  const ExpertRange grad = expert_range(*g, cfg_, first_, E_local_);
  const float* xr = local ? k.xp.data() : k.xr.data();
  const float* dyr = local ? k.dy.data() : k.dyr.data();
  float* dxr = local ? k.dxp.ensure(k.layout.R * C) : k.dxr.ensure(plan.R_recv * C);
  for (int q = 0; q < plan.P; ++q) {
    const int64_t at = plan.recv_offset[q] * C;
    experts_backward(dxr + at, grad, dyr + at, xr + at, plan.recv_counts.data() + q * E_local_,
                     range, C, cfg_.F, k.acts[q]);
  }
}

void ExpertParallelMoe::forward(float* out, const float* inp, int64_t N, const MoeWeights& w,
                                const MoeStep& step) {
  const int64_t C = cfg_.C, E = cfg_.E, K = cfg_.K;
  MOETRAIN_CHECK(N >= 0, "ExpertParallelMoe::forward: N is {}, must be >= 0", N);
  MOETRAIN_CHECK(N == 0 || (out && inp), "ExpertParallelMoe::forward: null out or inp for N={}", N);
  MOETRAIN_CHECK(w.gate && w.w1 && w.w3 && w.w2,
                 "ExpertParallelMoe::forward: gate, w1, w3 and w2 must all be set");
  MOETRAIN_CHECK(cfg_.router != RouterKind::NoisyTopK || w.noise,
                 "ExpertParallelMoe::forward: noisy_topk needs w.noise");
  MOETRAIN_CHECK(cfg_.shared_F == 0 || (w.shared_w1 && w.shared_w3 && w.shared_w2),
                 "ExpertParallelMoe::forward: shared_F={} needs the shared expert weights",
                 cfg_.shared_F);
  timings_ = MoeTimings{};
  a2a_busy_ = 0;
  has_forward_ = false;
  N_ = N;
  inp_ = inp;

  stats_.capacity = 0;
  stats_.dropped = 0;
  {
    ScopedTimer timer(timings_.router);
    router_forward(routing_, router_cache_, inp, N, cfg_, w.gate, w.noise, bias_.data(), step);
    if (is_token_choice(cfg_.router) && cfg_.capacity_factor > 0.0f) {
      stats_.capacity = expert_capacity(N, K, E, cfg_.capacity_factor);
      stats_.dropped = apply_capacity(routing_, stats_.capacity);
    } else if (cfg_.router == RouterKind::ExpertChoice) {
      float cf = cfg_.capacity_factor > 0.0f ? cfg_.capacity_factor : 1.0f;
      stats_.capacity = expert_capacity(N, K, E, cf);
    }
  }
  {
    ScopedTimer timer(timings_.losses);
    balance_losses(N);  // the comm thread is idle here: every layer drains before returning
    if (cfg_.router == RouterKind::SigmoidBias && step.training) {
      for (int64_t i = 0; i < N * routing_.S; ++i) ++pending_load_[routing_.selected[i]];
    }
  }
  const int n = static_cast<int>(chunks_.size());
  {
    ScopedTimer timer(timings_.permute);
    for (int c = 0; c < n; ++c) {
      Chunk& k = chunks_[c];
      k.t0 = N * c / n;
      k.N = N * (c + 1) / n - k.t0;
      slice_routing(k.routing, routing_, k.t0, k.N);
      build_layout(k.layout, k.routing);
      permute_forward(k.xp.ensure(k.layout.R * C), inp + k.t0 * C, k.layout, C);
    }
  }
  const bool local = a2a_.size() == 1;
  std::vector<CommThread::Ticket> landed(n), returned(n);
  for (int c = 0; c < n; ++c) {
    Chunk* k = &chunks_[c];
    landed[c] = communicate([this, k, E, C, local] {
      a2a_plan(k->plan, route_, k->layout.counts.data(), E, C);
      if (!local)
        a2a_dispatch(k->xr.ensure(k->plan.R_recv * C), k->xp.data(), k->plan, route_, k->scratch,
                     opts_.a2a_dtype);
    });
  }
  if (cfg_.shared_F > 0) {
    ScopedTimer timer(timings_.shared);
    experts_forward(out, inp, &N_, shared_expert_range(w), C, cfg_.shared_F, shared_acts_);
  }
  for (int c = 0; c < n; ++c) {
    Chunk* k = &chunks_[c];
    wait(landed[c]);
    experts(*k, w, true, nullptr);
    if (!local)
      returned[c] = communicate([this, k, C] {
        a2a_combine(k->y.ensure(k->layout.R * C), k->yr.data(), k->plan, route_, k->scratch,
                    opts_.a2a_dtype);
      });
  }
  if (!local && n > 0) wait(returned[n - 1]);
  timings_.a2a += a2a_busy_;
  {
    ScopedTimer timer(timings_.combine);
    for (Chunk& k : chunks_)
      if (k.N > 0) combine_forward(out + k.t0 * C, k.y.data(), k.layout, C, cfg_.shared_F > 0);
  }

  std::fill(stats_.tokens_per_expert.begin(), stats_.tokens_per_expert.end(), 0);
  stats_.unrouted_tokens = 0;
  for (const Chunk& k : chunks_) {
    for (int64_t e = 0; e < E; ++e) stats_.tokens_per_expert[e] += k.layout.counts[e];
    for (int64_t t = 0; t < k.N; ++t) {
      bool routed = false;
      for (int64_t s = 0; s < routing_.S; ++s) routed |= k.layout.slot_row[t * routing_.S + s] >= 0;
      stats_.unrouted_tokens += !routed;
    }
  }
  stats_.assignments = 0;
  for (int32_t e : routing_.selected) stats_.assignments += e >= 0;
  stats_.fraction_dropped = stats_.assignments > 0 ? static_cast<double>(stats_.dropped) /
                                                         static_cast<double>(stats_.assignments)
                                                   : 0.0;
  has_forward_ = true;
}

void ExpertParallelMoe::backward(float* dinp, const float* dout, const MoeWeights& w,
                                 const MoeWeights& g, float loss_weight) {
  MOETRAIN_CHECK(has_forward_, "ExpertParallelMoe::backward called without a completed forward");
  const int64_t N = N_, C = cfg_.C, E = cfg_.E, S = routing_.S;
  MOETRAIN_CHECK(N == 0 || (dinp && dout),
                 "ExpertParallelMoe::backward: null dinp or dout for N={}", N);
  MOETRAIN_CHECK(g.gate && g.w1 && g.w3 && g.w2,
                 "ExpertParallelMoe::backward: gradients of gate, w1, w3 and w2 must be set");
  MOETRAIN_CHECK(!router_cache_.noisy || g.noise,
                 "ExpertParallelMoe::backward: noisy_topk in training needs g.noise");
  MOETRAIN_CHECK(cfg_.shared_F == 0 || (g.shared_w1 && g.shared_w3 && g.shared_w2),
                 "ExpertParallelMoe::backward: shared_F={} needs the shared expert gradients",
                 cfg_.shared_F);
  a2a_busy_ = 0;
  const bool local = a2a_.size() == 1;
  const int n = static_cast<int>(chunks_.size());
  dweight_.resize(N * S);
  std::vector<CommThread::Ticket> landed(n), returned(n);
  for (int c = 0; c < n; ++c) {
    Chunk* k = &chunks_[c];
    {
      ScopedTimer timer(timings_.combine);
      combine_backward(k->dy.ensure(k->layout.R * C), dweight_.data() + k->t0 * S, dout + k->t0 * C,
                       k->y.data(), k->layout, C);
    }
    if (!local)
      landed[c] = communicate([this, k, C] {
        a2a_dispatch(k->dyr.ensure(k->plan.R_recv * C), k->dy.data(), k->plan, route_, k->scratch,
                     opts_.a2a_dtype);
      });
  }
  if (cfg_.shared_F > 0 && N > 0) {
    ScopedTimer timer(timings_.shared);
    experts_backward(dinp, shared_expert_range(g), dout, inp_, &N_, shared_expert_range(w), C,
                     cfg_.shared_F, shared_acts_);
  }
  for (int c = 0; c < n; ++c) {
    Chunk* k = &chunks_[c];
    if (!local) wait(landed[c]);
    experts(*k, w, false, &g);
    if (!local)
      returned[c] = communicate([this, k, C] {
        a2a_combine(k->dxp.ensure(k->layout.R * C), k->dxr.data(), k->plan, route_, k->scratch,
                    opts_.a2a_dtype);
      });
  }
  if (!local && n > 0) wait(returned[n - 1]);
  timings_.a2a += a2a_busy_;
  if (N == 0) return;
  {
    ScopedTimer timer(timings_.permute);
    for (Chunk& k : chunks_)
      if (k.N > 0) permute_backward(dinp + k.t0 * C, k.dxp.data(), k.layout, C, cfg_.shared_F > 0);
  }
  RouterGrads grads;
  grads.dweight = dweight_.data();
  {
    ScopedTimer timer(timings_.losses);
    const float aux_scale = cfg_.aux_loss_coef * loss_weight;
    if (has_aux_loss(cfg_.router) && aux_scale != 0.0f) {
      dprobs_.resize(N * E);
      // Global f_i, local token count: this rank's share of ∂(E Σ f_i P_i), P over all tokens.
      aux_loss_backward(dprobs_.data(), frac_.data(), N, E, aux_scale);
      grads.dprobs = dprobs_.data();
    }
    const float z_scale = cfg_.z_loss_coef * loss_weight;
    if (z_scale != 0.0f) {
      dz_.resize(N * E);
      z_loss_backward(dz_.data(), router_cache_.logits.data(), router_cache_.lse.data(), N, E,
                      z_scale);
      grads.dlogits = dz_.data();
    }
  }
  {
    ScopedTimer timer(timings_.router);
    router_backward(dinp, g.gate, g.noise, grads, inp_, w.gate, w.noise, routing_, router_cache_,
                    cfg_);
  }
}

void ExpertParallelMoe::apply_bias_update(const int64_t* global_load) {
  MOETRAIN_CHECK(cfg_.router == RouterKind::SigmoidBias,
                 "apply_bias_update: router is {}, only sigmoid_bias has a bias",
                 router_kind_name(cfg_.router));
  MOETRAIN_CHECK(global_load != nullptr, "apply_bias_update: null load");
  bias_update(bias_.data(), global_load, cfg_.E, cfg_.bias_update_rate);
  std::fill(pending_load_.begin(), pending_load_.end(), 0);
}

}  // namespace moetrain
