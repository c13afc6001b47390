#include "moe/expert_pipeline.h"

#include <algorithm>

#include "core/check.h"
#include "core/timer.h"
#include "moe/slot_routing.h"

namespace moetrain {

namespace {
// Tokens [t0, t0 + n) of r.
void slice_routing(Routing& out, const Routing& r, int64_t t0, int64_t n) {
  const int64_t S = r.S;
  out.N = n, out.E = r.E, out.S = S;
  out.selected.assign(r.selected.begin() + t0 * S, r.selected.begin() + (t0 + n) * S);
  out.expert.assign(r.expert.begin() + t0 * S, r.expert.begin() + (t0 + n) * S);
  out.weight.assign(r.weight.begin() + t0 * S, r.weight.begin() + (t0 + n) * S);
}
}  // namespace

ExpertPipeline::ExpertPipeline(const MoeConfig& cfg, ExpertExchange& exchange, Comm* etp)
    : cfg_(cfg), ex_(exchange) {
  if (etp && etp->size() > 1) {
    MOETRAIN_CHECK(cfg_.F % etp->size() == 0,
                   "dist.etp = {} does not divide the expert hidden size {}", etp->size(), cfg_.F);
    etp_ = etp, T_ = etp->size(), s_ = etp->rank();
  }
  Fs_ = cfg_.F / T_;
  const ExpertOwnership own = ex_.ownership();
  MOETRAIN_CHECK(own.P >= 1 && own.q >= 0 && own.q < own.P,
                 "expert exchange: process {} of a group of {}", own.q, own.P);
  MOETRAIN_CHECK(
      cfg_.E % own.P == 0,
      "expert parallelism over {} ranks needs a multiple of {} experts, the model has {}", own.P,
      own.P, cfg_.E);
  const int n = ex_.chunks();
  MOETRAIN_CHECK(n >= 1, "all-to-all chunks = {}: must be at least 1", n);
  P_ = own.P, q_ = own.q;
  chunks_.resize(static_cast<std::size_t>(n));
  for (int c = 0; c < n; ++c) chunks_[c].index = c;
  landed_.assign(chunks_.size(), 0);
  returned_.assign(chunks_.size(), 0);
  set_placement(nullptr);
}

void ExpertPipeline::set_placement(const Placement* p) {
  MOETRAIN_CHECK(!p || !etp_, "expert placement under expert tensor parallelism (dist.etp = {})",
                 T_);
  MOETRAIN_CHECK(!p || (p->E == cfg_.E && p->P == P_),
                 "expert placement over {} experts and {} ranks for a layer of {} experts on {}",
                 p ? p->E : 0, p ? p->P : 0, cfg_.E, P_);
  placement_ = p;
  E_ex_ = p ? p->slots() : cfg_.E;
  E_local_ = p ? p->slots_per_rank : cfg_.E / P_;
  first_ = q_ * E_local_;
  slot_expert_.clear();
  if (p)
    slot_expert_.assign(p->slot_expert.begin() + first_,
                        p->slot_expert.begin() + first_ + E_local_);
  size_acts();
}

void ExpertPipeline::size_acts() {
  const auto n = static_cast<std::size_t>(placement_ ? P_ * E_local_ : P_ * T_);
  if (scratch_) {
    if (scratch_->acts.size() < chunks_.size()) scratch_->acts.resize(chunks_.size());
    if (recompute_ == Recompute::Full && scratch_->rows.size() < chunks_.size())
      scratch_->rows.resize(chunks_.size());
  }
  for (Chunk& k : chunks_)
    if (acts(k).size() < n) acts(k).resize(n);
}

void ExpertPipeline::set_recompute(Recompute r, RecomputeScratch* scratch) {
  recompute_ = r;
  scratch_ = r == Recompute::None ? nullptr : scratch;
  size_acts();
}

int64_t ExpertPipeline::received_rows() const {
  int64_t n = 0;
  for (const Chunk& k : chunks_) n += k.plan.R_recv;
  return n;
}

void ExpertPipeline::routed_counts(int64_t* tokens_per_expert, int64_t* unrouted_tokens) const {
  for (int64_t e = 0; e < cfg_.E; ++e) tokens_per_expert[e] = 0;
  *unrouted_tokens = 0;
  std::vector<int64_t> per_expert(static_cast<std::size_t>(cfg_.E));
  for (const Chunk& k : chunks_) {
    const int64_t S = k.routing.S;
    if (placement_ && static_cast<int64_t>(k.layout.counts.size()) == E_ex_)
      slot_counts_to_experts(per_expert.data(), k.layout.counts.data(), *placement_);
    else
      per_expert.assign(k.layout.counts.begin(), k.layout.counts.end());
    for (int64_t e = 0; e < cfg_.E; ++e) tokens_per_expert[e] += per_expert[e];
    for (int64_t t = 0; t < k.N; ++t) {
      bool routed = false;
      for (int64_t s = 0; s < S; ++s) routed |= k.layout.slot_row[t * S + s] >= 0;
      *unrouted_tokens += !routed;
    }
  }
}

void ExpertPipeline::add_times(MoeTimings& t) {
  const ExchangeTimes x = ex_.take_times();
  t.a2a += x.busy;
  t.a2a_wait += x.waited;
  t.a2a_bytes += x.bytes;
}

// The chunk's rows through this process's experts, one grouped pass per source's block.
void ExpertPipeline::experts(Chunk& k, const MoeWeights& w, const MoeWeights* g, MoeTimings& t,
                             float* y_out) {
  ScopedTimer timer(t.experts);
  const int64_t C = cfg_.C;
  const ExchangeLayout& plan = k.plan;
  if (etp_) {
    float* out = g ? rows(k).dxr.ensure(plan.R_recv * C)
                   : y_out ? y_out : rows(k).yr.ensure(plan.R_recv * C);
    return etp_experts(k, w, g, out);
  }
  if (placement_) {
    // Slot by slot: a slot's rows run through its logical expert's weights (and gradients).
    float* out = g ? rows(k).dxr.ensure(plan.R_recv * C) : y_out ? y_out : rows(k).yr.ensure(plan.R_recv * C);
    for (int q = 0; q < plan.P; ++q) {
      int64_t at = plan.recv_offset[q];
      for (int64_t j = 0; j < E_local_; ++j) {
        const int64_t* rows = plan.recv_counts.data() + q * E_local_ + j;
        if (*rows == 0) continue;
        const int64_t e = slot_expert_[j];
        MOETRAIN_CHECK(e >= 0, "expert slot {} has rows but no expert", first_ + j);
        const ExpertRange range = expert_range(w, cfg_, e, 1);
        ExpertActs& ea = acts(k)[q * E_local_ + j];
        if (!g)
          experts_forward(out + at * C, k.xr_rows + at * C, rows, range, C, cfg_.F, ea);
        else
          experts_backward(out + at * C, expert_range(*g, cfg_, e, 1), k.dyr_rows + at * C,
                           k.xr_rows + at * C, rows, range, C, cfg_.F, ea);
        at += *rows;
      }
    }
    return;
  }
  const ExpertRange range = expert_range(w, cfg_, first_, E_local_);
  if (!g) {
    float* yr = y_out ? y_out : rows(k).yr.ensure(plan.R_recv * C);
    for (int q = 0; q < plan.P; ++q) {
      const int64_t at = plan.recv_offset[q] * C;
      experts_forward(yr + at, k.xr_rows + at, plan.recv_counts.data() + q * E_local_, range, C,
                      cfg_.F, acts(k)[q]);
    }
    return;
  }
  const ExpertRange grad = expert_range(*g, cfg_, first_, E_local_);
  float* dxr = rows(k).dxr.ensure(plan.R_recv * C);
  for (int q = 0; q < plan.P; ++q) {
    const int64_t at = plan.recv_offset[q] * C;
    experts_backward(dxr + at, grad, k.dyr_rows + at, k.xr_rows + at,
                     plan.recv_counts.data() + q * E_local_, range, C, cfg_.F, acts(k)[q]);
  }
}

ExpertRange ExpertPipeline::etp_shard(const MoeWeights& w, FloatBuffer (&into)[3]) const {
  const int64_t C = cfg_.C, F = cfg_.F, Fs = Fs_, f0 = s_ * Fs_, El = E_local_;
  const ExpertRange whole = expert_range(w, cfg_, first_, El);
  ExpertRange r;
  r.first = first_, r.count = El;
  r.w1 = into[0].ensure(El * Fs * C);
  r.w3 = into[1].ensure(El * Fs * C);
  r.w2 = into[2].ensure(El * C * Fs);
  for (int64_t j = 0; j < El; ++j) {
    // w1, w3: the shard's hidden rows are one run; w2: Fs columns of each of its C rows.
    std::copy_n(whole.w1 + j * F * C + f0 * C, Fs * C, r.w1 + j * Fs * C);
    std::copy_n(whole.w3 + j * F * C + f0 * C, Fs * C, r.w3 + j * Fs * C);
    for (int64_t c = 0; c < C; ++c)
      std::copy_n(whole.w2 + j * C * F + c * F + f0, Fs, r.w2 + j * C * Fs + c * Fs);
  }
  return r;
}

void ExpertPipeline::etp_experts(Chunk& k, const MoeWeights& w, const MoeWeights* g, float* out) {
  const int64_t C = cfg_.C, F = cfg_.F, Fs = Fs_, f0 = s_ * Fs_, El = E_local_;
  const ExchangeLayout& plan = k.plan;
  const int64_t PE = plan.P * El;
  const auto T = static_cast<std::size_t>(T_);
  std::vector<int64_t> counts(T), row_counts(T);
  if (!g) {
    // The forward learns the peers' layouts once; the backward reuses them.
    k.peer_counts.resize(T * PE);
    counts.assign(T, PE);
    etp_->allgather(k.peer_counts.data(), plan.recv_counts.data(), counts);
    k.peer_rows.assign(T, 0);
    for (std::size_t i = 0; i < T; ++i)
      for (int64_t x = 0; x < PE; ++x) k.peer_rows[i] += k.peer_counts[i * PE + x];
  }
  int64_t Rg = 0;
  for (std::size_t i = 0; i < T; ++i) row_counts[i] = k.peer_rows[i] * C, Rg += k.peer_rows[i];
  MOETRAIN_CHECK(k.peer_rows[s_] == plan.R_recv,
                 "expert tensor parallelism: {} rows received, {} in the gathered layout",
                 plan.R_recv, k.peer_rows[s_]);
  if (!g) etp_->allgather(k.xg.ensure(Rg * C), k.xr_rows, row_counts);
  else etp_->allgather(k.dyg.ensure(Rg * C), k.dyr_rows, row_counts);
  const ExpertRange shard = etp_shard(w, wshard_);
  ExpertRange gshard;
  if (g) {
    gshard.first = first_, gshard.count = El;
    gshard.w1 = gshard_[0].ensure(El * Fs * C);
    gshard.w3 = gshard_[1].ensure(El * Fs * C);
    gshard.w2 = gshard_[2].ensure(El * C * Fs);
    for (FloatBuffer& b : gshard_) std::fill_n(b.data(), El * Fs * C, 0.0f);
  }
  // One grouped pass per (peer, source) block, as the rows arrived at that peer.
  float* part = g ? k.dxg.ensure(Rg * C) : k.yg.ensure(Rg * C);
  int64_t at = 0;
  for (std::size_t i = 0; i < T; ++i)
    for (int q = 0; q < plan.P; ++q) {
      const int64_t* cnt = k.peer_counts.data() + i * PE + q * El;
      ExpertActs& ea = acts(k)[i * static_cast<std::size_t>(plan.P) + q];
      if (!g)
        experts_forward(part + at * C, k.xg.data() + at * C, cnt, shard, C, Fs, ea);
      else
        experts_backward(part + at * C, gshard, k.dyg.data() + at * C, k.xg.data() + at * C, cnt,
                         shard, C, Fs, ea);
      for (int64_t j = 0; j < El; ++j) at += cnt[j];
    }
  // Every peer's partial sums over its hidden units, back to the rows each peer brought.
  etp_->reduce_scatter(out, part, row_counts);
  if (!g) return;
  const ExpertRange whole = expert_range(*g, cfg_, first_, El);
  for (int64_t j = 0; j < El; ++j) {
    float* d1 = whole.w1 + j * F * C + f0 * C;
    float* d3 = whole.w3 + j * F * C + f0 * C;
    const float* s1 = gshard.w1 + j * Fs * C;
    const float* s3 = gshard.w3 + j * Fs * C;
    for (int64_t x = 0; x < Fs * C; ++x) d1[x] += s1[x], d3[x] += s3[x];
    for (int64_t c = 0; c < C; ++c) {
      float* d2 = whole.w2 + j * C * F + c * F + f0;
      const float* s2 = gshard.w2 + j * C * Fs + c * Fs;
      for (int64_t x = 0; x < Fs; ++x) d2[x] += s2[x];
    }
  }
}

void ExpertPipeline::send(const float* inp, const Routing& routing, MoeTimings& t) {
  const int64_t C = cfg_.C, E = E_ex_, N = routing.N;
  MOETRAIN_CHECK(routing.E == E, "expert pipeline: a routing over {} experts, the exchange has {}",
                 routing.E, E);
  const int n = static_cast<int>(chunks_.size());
  ex_.take_times();  // what earlier work left behind is not this forward's
  {
    ScopedTimer timer(t.permute);
    for (int c = 0; c < n; ++c) {
      Chunk& k = chunks_[c];
      k.t0 = N * c / n;
      k.N = N * (c + 1) / n - k.t0;
      slice_routing(k.routing, routing, k.t0, k.N);
      build_layout(k.layout, k.routing);
      permute_forward(rows(k).xp.ensure(k.layout.R * C), inp + k.t0 * C, k.layout, C);
    }
  }
  for (int c = 0; c < n; ++c) {
    Chunk* k = &chunks_[c];
    landed_[c] = ex_.post([this, k, E, C] {
      ex_.plan(k->plan, k->layout.counts.data(), E, C);
      k->xr_rows = ex_.dispatch(rows(*k).xp.data(), k->plan, rows(*k).xr);
    });
  }
}

void ExpertPipeline::replay_send(const float* inp, MoeTimings& t) {
  const int64_t C = cfg_.C;
  ex_.take_times();
  {
    ScopedTimer timer(t.permute);
    for (Chunk& k : chunks_)
      permute_forward(rows(k).xp.ensure(k.layout.R * C), inp + k.t0 * C, k.layout, C);
  }
  for (std::size_t c = 0; c < chunks_.size(); ++c) {
    Chunk* k = &chunks_[c];
    landed_[c] = ex_.post([this, k] { k->xr_rows = ex_.dispatch(rows(*k).xp.data(), k->plan, rows(*k).xr); });
  }
}

void ExpertPipeline::release() {
  for (FloatBuffer& b : wshard_) b.release();
  for (FloatBuffer& b : gshard_) b.release();
  for (Chunk& k : chunks_) {
    k.xr_rows = k.y_rows = k.dyr_rows = k.dxp_rows = nullptr;
    for (FloatBuffer* b : {&k.xg, &k.yg, &k.dyg, &k.dxg}) b->release();
    if (!scratch_ || recompute_ != Recompute::Full)
      for (FloatBuffer* b : {&rows(k).xp, &rows(k).y, &rows(k).dy, &rows(k).dxp, &rows(k).xr,
                             &rows(k).yr, &rows(k).dyr, &rows(k).dxr})
        b->release();
    if (!scratch_)
      for (ExpertActs& a : acts(k)) a.release();
  }
  recompute_y_.release();
}

int64_t ExpertPipeline::held_bytes() const {
  // What this pipeline owns; shared scratch is counted by its owner.
  int64_t n = recompute_y_.bytes();
  for (const FloatBuffer& b : wshard_) n += b.bytes();
  for (const FloatBuffer& b : gshard_) n += b.bytes();
  for (const Chunk& k : chunks_) {
    for (const FloatBuffer* b : {&k.xg, &k.yg, &k.dyg, &k.dxg}) n += b->bytes();
    const PipelineRows& r = k.own_rows;
    for (const FloatBuffer* b : {&r.xp, &r.y, &r.dy, &r.dxp, &r.xr, &r.yr, &r.dyr, &r.dxr})
      n += b->bytes();
    for (const ExpertActs& a : k.own_acts) n += a.forward_bytes() + a.scratch_bytes();
  }
  return n;
}

void ExpertPipeline::compute(const MoeWeights& w, MoeTimings& t) {
  for (std::size_t c = 0; c < chunks_.size(); ++c) {
    Chunk* k = &chunks_[c];
    ex_.wait(landed_[c]);
    experts(*k, w, nullptr, t);
    if (recompute_ == Recompute::Moe && !scratch_)
      for (ExpertActs& a : acts(*k)) a.release();
    returned_[c] = ex_.post([this, k] { k->y_rows = ex_.combine(rows(*k).yr.data(), k->plan, rows(*k).y); });
  }
}

void ExpertPipeline::combine(float* out, bool accumulate, MoeTimings& t) {
  ex_.wait(returned_.back());
  add_times(t);
  ScopedTimer timer(t.combine);
  for (Chunk& k : chunks_)
    if (k.N > 0) combine_forward(out + k.t0 * cfg_.C, k.y_rows, k.layout, cfg_.C, accumulate);
}

void ExpertPipeline::send_backward(float* dweight, const float* dout, MoeTimings& t) {
  const int64_t C = cfg_.C;
  ex_.take_times();
  for (std::size_t c = 0; c < chunks_.size(); ++c) {
    Chunk* k = &chunks_[c];
    {
      ScopedTimer timer(t.combine);
      moetrain::combine_backward(rows(*k).dy.ensure(k->layout.R * C), dweight + k->t0 * k->routing.S,
                                 dout + k->t0 * C, k->y_rows, k->layout, C);
    }
    landed_[c] = ex_.post([this, k] { k->dyr_rows = ex_.dispatch(rows(*k).dy.data(), k->plan, rows(*k).dyr); });
  }
}

void ExpertPipeline::compute_backward(const MoeWeights& w, const MoeWeights& g, MoeTimings& t) {
  for (std::size_t c = 0; c < chunks_.size(); ++c) {
    Chunk* k = &chunks_[c];
    ex_.wait(landed_[c]);
    if (recompute_ == Recompute::Moe) {
      // The intermediates again, from the rows received; the outputs are not used (timed apart:
      // the forward's figures stay the forward's).
      MoeTimings again;
      FloatBuffer& y = scratch_ ? scratch_->y : recompute_y_;
      experts(*k, w, nullptr, again, y.ensure(k->plan.R_recv * cfg_.C));
    }
    experts(*k, w, &g, t);
    if (recompute_ == Recompute::Moe && !scratch_)
      for (ExpertActs& a : acts(*k)) a.release();
    returned_[c] =
        ex_.post([this, k] { k->dxp_rows = ex_.combine(rows(*k).dxr.data(), k->plan, rows(*k).dxp); });
  }
  if (recompute_ == Recompute::Moe) recompute_y_.release();
}

void ExpertPipeline::combine_backward(float* dinp, bool accumulate, MoeTimings& t) {
  ex_.wait(returned_.back());
  add_times(t);
  ScopedTimer timer(t.permute);
  for (Chunk& k : chunks_)
    if (k.N > 0) permute_backward(dinp + k.t0 * cfg_.C, k.dxp_rows, k.layout, cfg_.C, accumulate);
}

}  // namespace moetrain
