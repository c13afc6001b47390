// The MoE layer over the MPI expert exchange against the layer on one process holding every rank's
// tokens: outputs, input gradients, balancing losses, gate and expert gradients, router loads.
// Ranks hold different numbers of tokens (one holds none), experts may get no rows anywhere, and a
// router can send everything to the experts of one rank. Capacity dropping and expert choice decide
// per rank (GShard's local groups): their reference runs each rank's tokens as a batch of its own.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "moe/moe_layer.h"
#include "parallel/groups.h"
#include "parallel/mpi_exchange.h"
#include "parallel/runtime.h"
#include "support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

struct Case {
  RouterKind router = RouterKind::TopKSoftmax;
  int64_t E = 8, K = 2, shared_F = 0;
  bool one_rank_takes_all = false;  // every token goes to experts 0 and 1 (EP index 0)
  int ranks_per_node = -1;          // ≥ 0: the 2-D all-to-all with this many ranks per node
  int chunks = 1;                   // token chunks per exchange
  bool threaded = false;            // exchanges on a CommThread
  float cf = 0.0f;                  // capacity factor
  Overflow overflow = Overflow::Drop;
  BalanceLoss balance_loss = BalanceLoss::Switch;
  // Capacity and expert choice decide per rank (GShard's local groups): the reference then runs
  // each rank's tokens as a batch of their own. Set for cf > 0 and expert_choice.
  bool local_groups() const { return cf > 0.0f || router == RouterKind::ExpertChoice; }
};

// max |a − b| over max |b|, for messages and a relative bound.
double rel_diff(const float* a, const float* b, int64_t n) {
  double d = 0, m = 1e-30;
  for (int64_t i = 0; i < n; ++i) {
    d = std::max(d, std::abs(double(a[i]) - double(b[i])));
    m = std::max(m, std::abs(double(b[i])));
  }
  return d / m;
}

// Tokens of rank r: 5 + 3r, except rank 1, which holds none. With per-rank groups, 6 + 3r except
// rank 3, so that two ranks already make two different groups.
int64_t tokens_of(int r, bool local_groups) {
  if (local_groups) return r == 3 ? 0 : 6 + 3 * r;
  return r == 1 ? 0 : 5 + 3 * r;
}

// The layer's output and input gradient on this rank, for comparing configurations bitwise.
struct Bits {
  std::vector<float> out, dinp, grads;
};

Bits run_case(const Case& c, int ep) {
  auto world = dist_world("mpi_exchange_test");
  const int P = world->size(), r = world->rank();
  ProcessGroups groups = make_process_groups(*world, ep);
  MoeConfig cfg;
  cfg.C = 16, cfg.F = 12, cfg.E = c.E, cfg.K = c.K, cfg.router = c.router;
  cfg.aux_loss_coef = 0.1f, cfg.z_loss_coef = 0.05f, cfg.shared_F = c.shared_F;
  cfg.bias_update_rate = 0.01f;
  cfg.capacity_factor = c.cf;
  cfg.overflow = c.overflow, cfg.balance_loss = c.balance_loss;
  // The aux loss reads loads over all ranks, which per-rank groups cannot reproduce.
  if (c.local_groups()) cfg.aux_loss_coef = 0.0f;
  const int64_t C = cfg.C, E = cfg.E;

  int64_t Ng = 0, first = 0;
  for (int q = 0; q < P; ++q) {
    if (q == r) first = Ng;
    Ng += tokens_of(q, c.local_groups());
  }
  const int64_t N = tokens_of(r, c.local_groups());

  MoeParamSizes sizes = moe_param_sizes(cfg);
  std::vector<float> params = random_vector(sizes.total(), 11, 0.5f);
  MoeWeights w = moe_weights_from_buffer(cfg, params.data());
  std::vector<float> x = random_vector(Ng * C, 12), R = random_vector(Ng * C, 13);
  if (c.one_rank_takes_all) {
    for (float& v : x) v = std::abs(v) + 0.1f;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < C; ++i) w.gate[e * C + i] = e < 2 ? 1.0f + 0.1f * e : -1.0f;
  }
  MoeStep step;
  step.training = true, step.seed = 5, step.step = 3;

  // One process, every token: in one batch, or rank by rank for per-rank groups.
  MoeLayer ref(cfg);
  std::vector<float> ref_out(Ng * C), ref_dinp(Ng * C), ref_grads(sizes.total(), 0.0f);
  MoeWeights ref_g = moe_weights_from_buffer(cfg, ref_grads.data());
  double ref_z = 0;
  std::vector<int64_t> ref_load(E, 0);
  int64_t ref_dropped = 0, ref_rerouted = 0;
  const bool local = c.local_groups();
  for (int64_t q = 0, at = 0; q < (local ? P : 1); ++q) {
    const int64_t n = local ? tokens_of(static_cast<int>(q), true) : Ng;
    ref.forward(ref_out.data() + at * C, x.data() + at * C, n, w, step);
    ref.backward(ref_dinp.data() + at * C, R.data() + at * C, w, ref_g, double(n) / Ng);
    ref_z += ref.z_loss() * double(n) / Ng;
    for (int64_t e = 0; e < E; ++e) ref_load[e] += ref.stats().tokens_per_expert[e];
    ref_dropped += ref.stats().dropped;
    ref_rerouted += ref.stats().rerouted;
    at += n;
  }

  // This rank's tokens through the expert-parallel layer.
  A2aHierarchy hier;
  A2aRoute route{groups.a2a.get()};
  if (c.ranks_per_node >= 0) {
    hier = make_a2a_hierarchy(*groups.a2a, c.ranks_per_node);
    route = hier.route(*groups.a2a);
  }
  CommThread thread;
  MpiExchangeOptions opts;
  opts.chunks = c.chunks;
  if (c.threaded) opts.thread = &thread;
  // Pure EP over a flat route: every rank its own node, so every row that leaves a rank counts.
  const bool count_bytes = ep == P && c.ranks_per_node < 0 && !c.local_groups();
  if (count_bytes) opts.ranks_per_node = 1;
  MpiExchange exchange(route, opts);
  MoeLayer layer(cfg, {&exchange, groups.moe_stats.get()});
  std::vector<float> out(N * C + 1, 0.0f), dinp(N * C + 1, 0.0f), grads(sizes.total(), 0.0f);
  MoeWeights g = moe_weights_from_buffer(cfg, grads.data());
  layer.forward(out.data(), x.data() + first * C, N, w, step);
  // The balancing losses are means over Ng tokens; this rank's share of their gradient is N/Ng.
  layer.backward(dinp.data(), R.data() + first * C, w, g, static_cast<float>(N) / Ng);

  const std::string where = "rank " + std::to_string(r) + " ep " + std::to_string(ep);
  if (count_bytes) {
    // Each routed row crosses four times: dispatch and combine, forward and backward.
    int64_t bytes = exchange.take_cross_node_bytes(), want = 0;
    groups.control->allreduce(&bytes, 1);
    const Routing& rt = ref.routing();
    for (int64_t t = 0, q = 0, end = tokens_of(0, false); t < Ng; ++t) {
      while (t >= end) end += tokens_of(static_cast<int>(++q), false);
      for (int64_t k = 0; k < rt.S; ++k) {
        const int32_t e = rt.expert[t * rt.S + k];
        want += e >= 0 && e / (E / P) != q ? 4 * C * int64_t(sizeof(float)) : 0;
      }
    }
    EXPECT_EQ(bytes, want) << where;
    // Every byte sent to another rank: the same rows, plus each plan's E/P row counts to each of
    // the P − 1 others (one plan per chunk; a flat route).
    int64_t sent = layer.timings().a2a_bytes;
    groups.control->allreduce(&sent, 1);
    EXPECT_EQ(sent, want + int64_t{P} * c.chunks * (P - 1) * (E / P) * int64_t(sizeof(int64_t)))
        << where;
  }
  EXPECT_LE(rel_diff(out.data(), ref_out.data() + first * C, N * C), 1e-5) << where;
  EXPECT_LE(rel_diff(dinp.data(), ref_dinp.data() + first * C, N * C), 1e-5) << where;
  if (!local) {
    EXPECT_NEAR(layer.aux_loss(), ref.aux_loss(), 1e-6 * (1 + ref.aux_loss())) << where;
  }
  double z = layer.z_loss() * static_cast<double>(N) / Ng;
  groups.control->allreduce(&z, 1);
  EXPECT_NEAR(z, ref_z, 1e-5 * ref_z) << where;

  // Replicated parameters: the sum over all ranks. Experts: this rank's, summed over its EDP group.
  std::vector<float> gate(g.gate, g.gate + sizes.gate);
  groups.grads->allreduce(gate.data(), sizes.gate);
  EXPECT_LE(rel_diff(gate.data(), ref_g.gate, sizes.gate), 1e-5) << where;
  if (sizes.shared_w1) {
    std::vector<float> sw2(g.shared_w2, g.shared_w2 + sizes.shared_w2);
    groups.grads->allreduce(sw2.data(), sizes.shared_w2);
    EXPECT_LE(rel_diff(sw2.data(), ref_g.shared_w2, sizes.shared_w2), 1e-5) << where;
  }
  const int64_t El = layer.local_experts(), e0 = layer.first_expert();
  EXPECT_EQ(e0, expert_shard(E, ep, groups.layout.ep_index).first);
  const int64_t each = cfg.F * C;
  for (auto [mine, want] : {std::pair{g.w1, ref_g.w1}, {g.w3, ref_g.w3}, {g.w2, ref_g.w2}}) {
    std::vector<float> own(mine + e0 * each, mine + (e0 + El) * each);
    groups.expert_grads->allreduce(own.data(), El * each);
    EXPECT_LE(rel_diff(own.data(), want + e0 * each, El * each), 1e-5) << where;
    // Other ranks' experts are not touched here.
    int64_t touched = 0;
    for (int64_t i = 0; i < E * each; ++i) {
      if (i < e0 * each || i >= (e0 + El) * each) touched += mine[i] != 0.0f;
    }
    EXPECT_EQ(touched, 0) << where;
  }

  // Routed rows summed over ranks = what one process routes; sigmoid_bias loads likewise.
  std::vector<int64_t> load = layer.stats().tokens_per_expert;
  groups.control->allreduce(load.data(), E);
  EXPECT_EQ(load, ref_load) << where;
  int64_t dropped = layer.stats().dropped;
  groups.control->allreduce(&dropped, 1);
  EXPECT_EQ(dropped, ref_dropped) << where;
  if (c.cf > 0.0f && c.router != RouterKind::ExpertChoice && c.overflow == Overflow::Drop) {
    EXPECT_GT(dropped, 0) << "nothing dropped";
  }
  if (c.overflow == Overflow::Reroute) {
    int64_t rerouted = layer.stats().rerouted;
    groups.control->allreduce(&rerouted, 1);
    EXPECT_EQ(rerouted, ref_rerouted) << where;
    EXPECT_GT(rerouted, 0) << "nothing rerouted";
  }
  if (c.one_rank_takes_all) {
    EXPECT_EQ(load[0] + load[1], Ng * c.K) << "tokens lost";
    int64_t group_tokens = N;  // tokens of this EP group, all sent to EP index 0
    groups.a2a->allreduce(&group_tokens, 1);
    EXPECT_EQ(layer.received_rows(), e0 == 0 ? group_tokens * c.K : 0) << where;
  }
  if (c.router == RouterKind::SigmoidBias && !local) {
    std::vector<int64_t> pending(layer.pending_load(), layer.pending_load() + E);
    groups.control->allreduce(pending.data(), E);
    EXPECT_EQ(pending, std::vector<int64_t>(ref.pending_load(), ref.pending_load() + E));
    layer.apply_bias_update(pending.data());
    ref.apply_bias_update();
    EXPECT_EQ(std::vector<float>(layer.router_bias(), layer.router_bias() + E),
              std::vector<float>(ref.router_bias(), ref.router_bias() + E));
  }
  return {out, dinp, grads};
}

// Every EP size that divides the world: P (pure EP), and smaller ones (DP × EP; 1 is pure DP).
std::vector<int> ep_sizes() {
  auto world = dist_world("ep_sizes");
  std::vector<int> out;
  for (int ep = 1; ep <= world->size(); ++ep)
    if (world->size() % ep == 0) out.push_back(ep);
  return out;
}

}  // namespace

TEST(MpiExchangeMoe, TopKSoftmaxMatchesOneProcess) {
  for (int ep : ep_sizes()) run_case({}, ep);
}

TEST(MpiExchangeMoe, SigmoidBiasWithSharedExpertMatchesOneProcess) {
  Case c;
  c.router = RouterKind::SigmoidBias, c.shared_F = 8, c.K = 3;
  for (int ep : ep_sizes()) run_case(c, ep);
}

TEST(MpiExchangeMoe, EverythingToOneRanksExpertsNeitherHangsNorLosesTokens) {
  Case c;
  c.one_rank_takes_all = true;
  for (int ep : ep_sizes()) run_case(c, ep);
}

TEST(MpiExchangeMoe, MoreRanksThanTokensPerExpert) {
  Case c;
  c.E = 4, c.K = 1;  // few rows: most (rank, expert) pairs exchange nothing
  for (int ep : ep_sizes()) run_case(c, ep);
}

TEST(MpiExchangeMoe, TwoDimensionalAllToAllMatchesOneProcess) {
  Case c;
  for (int ep : ep_sizes()) {
    for (int per_node = 1; per_node <= ep; ++per_node) {
      if (ep % per_node != 0) continue;
      c.ranks_per_node = per_node;
      run_case(c, ep);
    }
  }
}

TEST(MpiExchangeMoe, ChunkedExchangesMatchOneProcessWithOrWithoutTheCommThread) {
  for (int ep : ep_sizes()) {
    for (int chunks : {2, 5}) {
      Case c;
      c.chunks = chunks, c.shared_F = 8;
      Bits inline_run = run_case(c, ep);
      c.threaded = true;
      Bits threaded = run_case(c, ep);
      // The thread only changes when exchanges run, never what is computed.
      EXPECT_EQ(inline_run.out, threaded.out);
      EXPECT_EQ(inline_run.dinp, threaded.dinp);
      EXPECT_EQ(inline_run.grads, threaded.grads);
    }
  }
}

TEST(MpiExchangeMoe, CapacityDropsPerRankAsLocalGroups) {
  Case c;
  c.cf = 1.0f;
  for (int ep : ep_sizes()) run_case(c, ep);
  c.router = RouterKind::SigmoidBias, c.cf = 0.75f, c.shared_F = 8;
  for (int ep : ep_sizes()) run_case(c, ep);
}

TEST(MpiExchangeMoe, CapacityReroutesPerRankAsLocalGroups) {
  Case c;
  c.cf = 0.75f, c.overflow = Overflow::Reroute;
  for (int ep : ep_sizes()) run_case(c, ep);
}

// The variance loss over every process equals the one-process loss, and so do its gradients.
TEST(MpiExchangeMoe, VarianceBalanceLossMatchesOneProcess) {
  Case c;
  c.balance_loss = BalanceLoss::Variance;
  for (int ep : ep_sizes()) run_case(c, ep);
}

TEST(MpiExchangeMoe, ExpertChoicePicksPerRankAsLocalGroups) {
  Case c;
  c.router = RouterKind::ExpertChoice;
  for (int ep : ep_sizes()) run_case(c, ep);
  c.cf = 2.0f, c.ranks_per_node = 1;
  for (int ep : ep_sizes()) run_case(c, ep);
}

TEST(MpiExchangeMoe, RejectsExpertCountsTheGroupCannotSplit) {
  auto world = dist_world("ep_reject");
  if (world->size() < 2) GTEST_SKIP() << "needs 2 or more processes (ctest runs it with 2 and 4)";
  MoeConfig cfg;
  cfg.C = 8, cfg.F = 8, cfg.E = world->size() + 1, cfg.K = 1;
  MpiExchange exchange(A2aRoute{world.get()});
  EXPECT_THROW(MoeLayer(cfg, {&exchange, world.get()}), Error);
}
