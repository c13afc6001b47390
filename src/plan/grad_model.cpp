#include "plan/grad_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "parallel/grad_wire.h"
#include "plan/kernel_table.h"
#include "plan/kernel_time.h"

namespace moetrain::plan {

LocalParams local_params(const ModelConfig& m, const RankLayout& l) {
  const ParamCounts pc = count_params(m);
  const int64_t etp = l.whole_params_under_tp ? 1 : l.etp;
  return {pc.dense / static_cast<double>(l.dense_split()),
          pc.expert / static_cast<double>(l.ep * etp * l.pp), l.dense_ranks(),
          l.world / (l.pp * l.ep * etp)};
}

namespace {

// P(X ≥ k) for X ~ Binomial(n, q), summed in log space (n is a step's micro-batches).
double binomial_tail(int64_t n, double q, int64_t k) {
  if (k <= 0 || q >= 1) return 1;
  if (q <= 0) return 0;
  if (k == 1) return -std::expm1(static_cast<double>(n) * std::log1p(-q));
  double tail = 0;
  for (int64_t i = k; i <= n; ++i)
    tail += std::exp(std::lgamma(n + 1.0) - std::lgamma(i + 1.0) - std::lgamma(n - i + 1.0) +
                     static_cast<double>(i) * std::log(q) +
                     static_cast<double>(n - i) * std::log1p(-q));
  return std::min(1.0, tail);
}

}  // namespace

ExpertActivity expert_activity(const LoadModel& load, const ModelConfig& m, int64_t ep,
                               double tokens, int64_t microbatches, double min_accum_fraction) {
  const int64_t E = m.n_experts, layers = m.n_moe_layers(), e_local = E / std::max<int64_t>(1, ep);
  if (layers == 0 || load.fractions.empty()) return {};
  const int64_t need = std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(min_accum_fraction * static_cast<double>(microbatches))));
  ExpertActivity a{0, 0};
  // Each load row once (layers beyond the rows share the last one, as in predict).
  const auto rows = static_cast<int64_t>(load.fractions.size());
  for (int64_t r = 0; r < std::min(rows, layers); ++r) {
    const double weight = r + 1 < rows ? 1.0 : static_cast<double>(layers - r);
    const auto& p = load.fractions[static_cast<std::size_t>(r)];
    double q_sum = 0, busiest = 0;
    for (int64_t rk = 0; rk < ep; ++rk) {
      double kept = 0;
      for (int64_t e = rk * e_local; e < (rk + 1) * e_local; ++e) {
        const double pick = std::min(1.0, static_cast<double>(m.top_k) * p[e]);
        const double q = pick >= 1 ? 1 : -std::expm1(tokens * std::log1p(-pick));
        q_sum += q;
        kept += binomial_tail(microbatches, q, need);
      }
      busiest = std::max(busiest, kept / static_cast<double>(e_local));
    }
    a.per_microbatch += weight * q_sum / static_cast<double>(E);
    a.busiest_rank += weight * busiest;
  }
  a.per_microbatch /= static_cast<double>(layers);
  a.busiest_rank /= static_cast<double>(layers);
  return a;
}

double add_reductions(const RunConfig& cfg, const ClusterSpec& cluster, const Layout& layout,
                      const LocalParams& local, double expert_share, CommBreakdown& cm) {
  const int64_t zero = zero_stage(cfg, layout);
  const double grad_elem =
      grad_wire_bytes(parse_grad_wire(cfg.dist.grad_reduce_dtype, "dist.grad_reduce_dtype"));
  // A stage's data-parallel ranks (tensor shards innermost) span nodes when there are more of
  // them than a node holds.
  const bool multi_node = layout.stage() * layout.tp > cluster.devices_per_node;
  const int64_t dense_ranks = local.dense_ranks;
  const double expert_sent = local.expert * expert_share;
  auto over = [](int64_t ranks) {
    return fmt::format("over {} rank{}", ranks, ranks == 1 ? "" : "s");
  };
  cm.reductions.emplace_back(
      "dense gradients " + over(dense_ranks),
      ring_allreduce(cluster, local.dense * grad_elem, dense_ranks, multi_node));
  cm.reductions.emplace_back(
      (expert_share < 1 ? fmt::format("expert gradients ({:.0f}% kept) ", 100 * expert_share)
                        : std::string("expert gradients ")) +
          over(local.expert_ranks),
      ring_allreduce(cluster, expert_sent * grad_elem, local.expert_ranks, multi_node));
  // Under EP without DP each rank's experts reduce over a group of one: nothing travels, but
  // the trainer's reduction (parallel/grad_sync.h) still packs, reduce-scatters, all-gathers
  // and unpacks them, at the rate measured for that (one process alone has no reduction).
  if (local.expert_ranks == 1 && dense_ranks > 1 && cluster.self_reduce_bandwidth > 0) {
    Collective copy;
    copy.kind = "copy";
    copy.phases.push_back({"packed and copied in place", 0, 0, expert_sent * 4,
                           cluster.self_reduce_bandwidth, 1});
    cm.reductions.emplace_back("expert gradients, a group of one", copy);
  }
  // ZeRO-3 keeps a shard of the weights: each layer's are all-gathered before its forward and
  // again before its backward. Two all-gathers of the weights move what one all-reduce of them
  // does (the same ring, (p − 1)/p of the bytes each), prefetched as the reduction overlaps.
  if (zero >= 3) {
    const double wbytes = static_cast<double>(dtype_size(cfg.train.precision_dtype()));
    cm.reductions.emplace_back(
        "dense weights all-gathered twice (ZeRO-3) " + over(dense_ranks),
        ring_allreduce(cluster, local.dense * wbytes, dense_ranks, multi_node));
    cm.reductions.emplace_back(
        "expert weights all-gathered twice (ZeRO-3) " + over(local.expert_ranks),
        ring_allreduce(cluster, local.expert * wbytes, local.expert_ranks, multi_node));
  }
  return (local.dense + expert_sent) * grad_elem;
}

namespace {

// Optimizer bytes per parameter per step: read parameter, gradient and the state slots, write
// parameter and slots; plus the clip's read of the gradient and the zeroing write, and the
// low-precision copy written after the update.
double optimizer_bytes_per_param(const std::string& name, DType precision) {
  const double slots = name == "adamw" ? 2 : 1;
  return 4 * (2 + slots) + 4 * (1 + slots) + 4 + 4 + (precision == DType::F32 ? 0 : 2);
}

}  // namespace

UpdateCost update_cost(const RunConfig& cfg, const DeviceModel& dev, const LocalParams& local,
                       int64_t zero, double kept) {
  const DType prec = cfg.train.precision_dtype();
  const double all = local.dense + local.expert;
  UpdateCost u;
  u.updated = zero >= 1 ? local.dense / static_cast<double>(local.dense_ranks) +
                              kept * local.expert / static_cast<double>(local.expert_ranks)
                        : local.dense + kept * local.expert;
  const double opt_bytes = optimizer_bytes_per_param(cfg.optim.name, prec);
  if (const auto per = dev.kernels.update_per_param(optimizer_code(cfg.optim.name)))
    u.seconds = *per * (u.updated + (all - u.updated) * 8 / opt_bytes) +
                (prec == DType::F32 ? 0 : stream_time(dev, 6 * all));  // the lp copy
  else
    u.seconds = stream_time(dev, u.updated * opt_bytes) +
                stream_time(dev, 8 * (all - u.updated));  // grads zeroed, clip read: everywhere
  u.seconds += stream_time(dev, reweight_bytes(cfg.grad.expert_reweight, local.expert));
  return u;
}

double reweight_bytes(const std::string& mode, double expert_params) {
  if (mode == "none") return 0;
  const double statistic = mode == "importance" || mode == "grad_norm" ? 4 : 0;
  return (statistic + 8) * expert_params;
}

}  // namespace moetrain::plan
