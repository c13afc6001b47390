// The MoE layer over the local exchange against the naive reference (moe_reference.h), and the
// layer's chunk pipeline over an exchange that really moves rows (a copy) in several chunks: what
// the expert-parallel exchanges do, without MPI.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/comm.h"
#include "moe/exchange.h"
#include "moe/moe_layer.h"
#include "moe_reference.h"
#include "support/error_bound.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// Every expert here, but rows are copied on dispatch and combine, work is queued until waited
// for (as on a communication thread), and tokens are cut into `chunks` runs.
class CopyingExchange final : public ExpertExchange {
 public:
  explicit CopyingExchange(int chunks) : chunks_(chunks) {}
  ExpertOwnership ownership() const override { return {}; }
  int chunks() const override { return chunks_; }
  Ticket post(std::function<void()> work) override {
    queue_.push_back(std::move(work));
    return ++posted_;
  }
  void wait(Ticket t) override {
    while (done_ < t) queue_[done_++]();
  }
  ExchangeTimes take_times() override { return {}; }
  void plan(ExchangeLayout& layout, const int64_t* counts, int64_t E, int64_t C) override {
    local_.plan(layout, counts, E, C);
  }
  const float* dispatch(const float* send, const ExchangeLayout& l, FloatBuffer& recv) override {
    return copy(send, l.R_recv * l.C, recv);
  }
  const float* combine(const float* rows, const ExchangeLayout& l, FloatBuffer& back) override {
    return copy(rows, l.R_send * l.C, back);
  }
  int64_t posted() const { return static_cast<int64_t>(posted_); }

 private:
  static const float* copy(const float* from, int64_t n, FloatBuffer& to) {
    float* p = to.ensure(n);
    if (n > 0) std::memcpy(p, from, static_cast<std::size_t>(n) * sizeof(float));
    return p;
  }
  int chunks_;
  LocalExchange local_;
  std::vector<std::function<void()>> queue_;
  Ticket posted_ = 0, done_ = 0;
};

struct Data {
  MoeConfig cfg;
  int64_t N;
  std::vector<float> params, inp, dout;
  MoeWeights w;
  Data(const MoeConfig& c, int64_t n) : cfg(c), N(n) {
    params = random_vector(moe_param_sizes(cfg).total(), 21, 0.5f);
    w = moe_weights_from_buffer(cfg, params.data());
    inp = random_vector(N * cfg.C, 22);
    dout = random_vector(N * cfg.C, 23);
  }
};

struct LayerRun {
  std::vector<float> out, dinp, grads;
  float aux = 0, z = 0;
  MoeStats stats;
};

LayerRun run(MoeLayer& layer, Data& d, const MoeStep& step) {
  LayerRun r;
  r.out.assign(d.N * d.cfg.C, 0.0f);
  r.dinp.assign(d.N * d.cfg.C, 0.0f);
  r.grads.assign(d.params.size(), 0.0f);
  MoeWeights g = moe_weights_from_buffer(d.cfg, r.grads.data());
  layer.forward(r.out.data(), d.inp.data(), d.N, d.w, step);
  layer.backward(r.dinp.data(), d.dout.data(), d.w, g, 0.5f);
  r.aux = layer.aux_loss(), r.z = layer.z_loss(), r.stats = layer.stats();
  return r;
}

MoeConfig config(RouterKind router, int64_t shared_F, float cf) {
  MoeConfig cfg;
  cfg.C = 8, cfg.F = 6, cfg.E = 4, cfg.K = 2;
  cfg.router = router, cfg.shared_F = shared_F, cfg.capacity_factor = cf;
  cfg.aux_loss_coef = 0.5f, cfg.z_loss_coef = 0.3f;
  return cfg;
}

const RouterKind kRouters[] = {RouterKind::TopKSoftmax, RouterKind::NoisyTopK,
                               RouterKind::ExpertChoice, RouterKind::SigmoidBias};

}  // namespace

// The default context, an explicit LocalExchange with a local communicator, and the reference:
// the same layer on one process whatever hands it its local pieces. N = 300 crosses the
// 256-token block of the balancing-loss sums.
TEST(LocalExchangeLayer, MatchesTheReferenceAndTheDefaultContext) {
  for (RouterKind router : kRouters) {
    for (int64_t N : {0, 1, 9, 300}) {
      Data d(config(router, N % 2 ? 5 : 0, router == RouterKind::TopKSoftmax ? 0.8f : 0.0f), N);
      MoeStep step;
      step.seed = 3, step.step = 2;
      MoeLayer plain(d.cfg);
      LocalExchange local;
      auto stats = make_local_comm("stats");
      MoeLayer explicit_local(d.cfg, {&local, stats.get()});
      const LayerRun a = run(plain, d, step), b = run(explicit_local, d, step);
      const std::string what = std::string(router_kind_name(router)) + " N=" + std::to_string(N);
      EXPECT_EQ(a.out, b.out) << what;
      EXPECT_EQ(a.dinp, b.dinp) << what;
      EXPECT_EQ(a.grads, b.grads) << what;
      EXPECT_EQ(a.aux, b.aux) << what;
      EXPECT_EQ(a.z, b.z) << what;
      EXPECT_EQ(plain.timings().a2a, 0.0) << what << ": nothing moves on one process";

      MoeReference ref = moe_reference(d.cfg, d.inp.data(), N, d.w, plain.router_bias(), step);
      expect_within(a.out.data(), ref.out.data(), N * d.cfg.C, what.c_str());
      EXPECT_EQ(a.stats.tokens_per_expert, ref.tokens_per_expert) << what;
      EXPECT_EQ(a.stats.dropped, ref.dropped) << what;
      EXPECT_EQ(a.stats.capacity, ref.capacity) << what;
      expect_within(a.aux, ref.aux, (what + " aux").c_str());
      expect_within(a.z, ref.z, (what + " z").c_str());
    }
  }
}

// Rows that really travel, in 1, 2 or 5 chunks with queued work: the same output and gradients
// as the local layer (chunks only regroup the expert GEMMs' rows, which the deterministic grouped
// GEMM computes row by row), and one plan+dispatch and one combine per chunk and direction.
TEST(LocalExchangeLayer, ChunkedCopyingExchangeMatchesTheLocalLayer) {
  for (RouterKind router : kRouters) {
    for (int chunks : {1, 2, 5}) {
      Data d(config(router, 5, 0.0f), 23);
      MoeStep step;
      step.seed = 4;
      MoeLayer plain(d.cfg);
      CopyingExchange copying(chunks);
      auto stats = make_local_comm("stats");
      MoeLayer chunked(d.cfg, {&copying, stats.get()});
      const LayerRun a = run(plain, d, step), b = run(chunked, d, step);
      const std::string what =
          std::string(router_kind_name(router)) + " chunks=" + std::to_string(chunks);
      expect_close(b.out.data(), a.out.data(), static_cast<int64_t>(a.out.size()), 1e-6, 1e-5,
                   what.c_str());
      expect_close(b.dinp.data(), a.dinp.data(), static_cast<int64_t>(a.dinp.size()), 1e-6, 1e-5,
                   what.c_str());
      expect_close(b.grads.data(), a.grads.data(), static_cast<int64_t>(a.grads.size()), 1e-6,
                   1e-5, what.c_str());
      EXPECT_EQ(a.aux, b.aux) << what;
      EXPECT_EQ(a.z, b.z) << what;
      EXPECT_EQ(a.stats.tokens_per_expert, b.stats.tokens_per_expert) << what;
      EXPECT_EQ(a.stats.unrouted_tokens, b.stats.unrouted_tokens) << what;
      EXPECT_EQ(copying.posted(), 4 * chunks) << what;
      EXPECT_EQ(chunked.received_rows(), plain.received_rows()) << what;
    }
  }
}

TEST(LocalExchangeLayer, RejectsZeroChunks) {
  CopyingExchange none(0);
  EXPECT_THROW(MoeLayer(config(RouterKind::TopKSoftmax, 0, 0.0f), {&none, nullptr}), Error);
}
