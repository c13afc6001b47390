// Every formula of the planner's step time, once, each with the reason it has that form (the memory
// model is in plan/memory_model.cpp, the collectives' phases in plan/comm_model.cpp). Times are
// seconds, sizes bytes, rates per second. One "process" is one device (a GPU, or a share of this
// CPU).
#include "plan/cost_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/check.h"
#include "core/dtype.h"
#include "plan/attention_model.h"
#include "plan/grad_model.h"
#include "plan/kernel_time.h"
#include "plan/placement_model.h"

namespace moetrain::plan {

namespace {

double bytes_of(DType t) {
  return static_cast<double>(dtype_size(t));
}

// Collectives of the step's metrics (train/step_metrics.cpp: loss parts, counts, expert loads,
// drops, use; train/rank_timing.cpp: the ranks' times).
constexpr double kMetricCollectives = 6;

}  // namespace

double backward_window(const StepParts& s) {
  // compute() holds the slowest rank's experts once (the balanced figure is not part of it);
  // the optimizer runs after the reduction, so it hides none of it.
  return 2.0 / 3.0 * (s.compute() - s.optimizer);
}

double overlap_exposed(double reduction, double buckets, double window) {
  if (reduction <= 0) return 0;
  return std::max(reduction / std::max(1.0, buckets), reduction - window);
}

double other_microbatch_hidden(const Layout& layout, const StepParts& s, int64_t A,
                               bool comm_shares_cores) {
  if (!layout.a2a_overlap || A < 2 || comm_shares_cores) return 0;
  // The layers' compute of the step (the LM head and the update are not beside an exchange);
  // the first micro-batch's has no other to overlap: (A − 1)/A of it. What the chunks already
  // hid behind the experts is not hidden twice.
  const double layers = s.attention + s.router + s.experts + s.shared_expert + s.norms;
  const double chunks_hid = s.a2a - s.a2a_exposed;
  const double window = static_cast<double>(A - 1) / static_cast<double>(A) * layers - chunks_hid;
  return std::clamp(window, 0.0, s.a2a_exposed);
}

namespace {

Prediction predict_impl(const RunConfig& cfg, const ClusterSpec& cluster, const Layout& layout,
                        const LoadModel& load_in, bool reference) {
  const ModelConfig& m = cfg.model;
  const DeviceModel& dev = cluster.device;
  const std::string problem = layout_problem(cfg, cluster, layout);
  MOETRAIN_CHECK(problem.empty(), "{}", problem);
  MOETRAIN_CHECK(!load_in.fractions.empty(), "the load model has no expert fractions");
  for (const auto& row : load_in.fractions)
    MOETRAIN_CHECK(static_cast<int64_t>(row.size()) == m.n_experts,
                   "the load model has {} experts per layer, model.n_experts = {}", row.size(),
                   m.n_experts);
  for (const auto& step : load_in.steps) {
    MOETRAIN_CHECK(!step.empty(), "the load model has a step without expert fractions");
    for (const auto& row : step)
      MOETRAIN_CHECK(static_cast<int64_t>(row.size()) == m.n_experts,
                     "the load model has a step with {} experts per layer, model.n_experts = {}",
                     row.size(), m.n_experts);
  }

  // Hot-expert replication re-plans the load over the ranks (plan/placement_model.h).
  const int64_t rpn = cfg.dist.hierarchical ? std::min(layout.ep, cluster.devices_per_node) : 0;
  const PlacedLoad placed = cfg.placement.spare_slots > 0 && layout.ep > 1
                                ? placed_load(load_in, layout.ep, cfg.placement.spare_slots, rpn)
                                : PlacedLoad{load_in, 0};
  const LoadModel& load = placed.load;
  Prediction p;
  p.layout = layout;
  p.pp_split = pp_split_name(layout, cfg.model.n_layers);
  // Resolved from the config: the ZeRO stage the run would have.
  p.layout.zero = zero_stage(cfg, layout);
  p.planner_only = planner_only(cfg, layout);
  const DType prec = cfg.train.precision_dtype();
  const int64_t B = cfg.train.batch_size, T = cfg.train.seq_len, A = cfg.train.grad_accum;
  const double N = static_cast<double>(B * T), C = m.dim, V = m.vocab_size;
  const double E = m.n_experts, K = m.top_k, F = m.expert_hidden;
  const int64_t ep = layout.ep, e_local = m.n_experts / ep;
  const int64_t tp = layout.tp, etp = layout.etp;
  // An expert's share of the hidden size on this rank: ETP splits each expert's columns.
  const double Fe = F / static_cast<double>(etp);
  StepParts& s = p.parts;
  // Element-wise work streams activations at their stored size: the run's precision on a GPU
  // in bf16/fp16, f32 in this trainer. The router's softmax and top-k stay f32.
  const double ab = activation_bytes(cfg, dev.threads == 0);
  // Tensor parallelism as the run's trainer has it (RankLayout::whole_params_under_tp): Megatron's
  // on an accelerator, this trainer's on a CPU (whole weights; whole stream unless SP).
  const RankLayout rl = rank_layout(cfg, layout, dev.threads == 0);
  const bool trainer_tp = rl.whole_params_under_tp && tp > 1;
  const bool trainer_sp = trainer_tp && cfg.dist.sequence_parallel;
  // Each TP collective is an all-reduce of the (N, C) activations (or its reduce-scatter /
  // all-gather pair, the same traffic), on the critical path: after the attention's output
  // projection and a dense FFN's (or Megatron's shared expert's) down projection forward, and of
  // their input gradients backward. This trainer joins them in f32, its activations' type.
  p.comm.tensor_parallel =
      ring_allreduce(cluster, N * C * (trainer_tp ? ab : bytes_of(prec)), tp, false);
  const double tp_allreduce_s = p.comm.tensor_parallel.seconds();

  // The experts of one MoE layer under the load model: the slowest rank's time and rows, and the
  // sums over the ranks. A layer's load is its row of the fractions (the last row for every
  // layer beyond them), so layers that share a row share the figures: computed once per row,
  // the plan costs O(layers + experts), not O(layers × experts).
  struct ExpertLoad {
    double worst = 0, sum = 0, worst_rows = 0, rows_sum = 0;
  };
  std::size_t load_rows = load.fractions.size();
  for (const auto& step : load.steps) load_rows = std::max(load_rows, step.size());
  std::vector<std::optional<ExpertLoad>> expert_loads(load_rows);
  // Sequence parallelism in the MoE block: each tensor shard routes its N / tp tokens, and the
  // experts' EP × ETP group folds over the TP × DP ranks (EP × ETP × EDP = TP × DP). An expert's
  // rows come from the tokens of all ep · etp ranks of the group: the exchange brings each rank
  // those its ep − 1 peers of the same ETP position routed there, and the ETP all-gather the
  // rest.
  const double Nm = N / static_cast<double>(tp);
  const double assignments = static_cast<double>(ep * etp) * Nm * K;
  const double cap =
      m.capacity_factor > 0 ? std::ceil(assignments / E * m.capacity_factor) : assignments;
  // The exchange's form: flat or 2-D as dist.hierarchical says, or deduplicated per node
  // (DeepEP) where the layout asks, sending a token's remote rows at dedup_share: distinct
  // nodes over rows, with node-limited routing where the model's groups are node-aligned
  // (model.route_groups groups, a token in at most model.route_group_topk of them).
  const int64_t a2a_nodes = (ep + std::min(ep, cluster.devices_per_node) - 1) /
                            std::min(ep, cluster.devices_per_node);
  double node_limit = 0;
  if (m.route_groups > 1 && m.route_group_topk > 0)
    node_limit = std::min(static_cast<double>(a2a_nodes),
                          static_cast<double>(m.route_group_topk) *
                              std::max(1.0, static_cast<double>(a2a_nodes) /
                                                static_cast<double>(m.route_groups)));
  const double dedup = dedup_share(m.n_experts, m.top_k, a2a_nodes, node_limit);
  auto exchange = [&](double bytes) {
    return layout.a2a_dedup ? alltoall_dedup(cluster, bytes, ep, dedup)
                            : alltoall(cluster, bytes, ep, cfg.dist.hierarchical);
  };
  auto expert_load = [&](int64_t l) -> const ExpertLoad& {
    auto& cached = expert_loads[std::min<std::size_t>(static_cast<std::size_t>(l), load_rows - 1)];
    if (cached) return *cached;
    // A measured load gives each step's fractions: every step waits for its own slowest rank,
    // so the slowest rank is found step by step and averaged (the summed load would average the
    // hot experts away).
    const std::size_t samples = std::max<std::size_t>(1, load.steps.size());
    ExpertLoad r;
    for (std::size_t smp = 0; smp < samples; ++smp) {
      const auto& rows_of = load.steps.empty() ? load.fractions : load.steps[smp];
      const auto& frac = rows_of[std::min<std::size_t>(l, rows_of.size() - 1)];
      double w = 0, w_rows = 0;
      for (int64_t rk = 0; rk < ep; ++rk) {
        double t = 0, rows = 0;
        for (int64_t e = rk * e_local; e < (rk + 1) * e_local; ++e) {
          const double n = std::min(cap, std::round(assignments * frac[e]));
          rows += n;
          // As timed at this expert shape: the expert kernels run once per source rank, on the
          // rows that rank sent (n / (ep · etp) of them at an even spread), each ETP rank over
          // its F / etp columns of every row.
          const double sources = static_cast<double>(ep * etp);
          if (const auto timed = dev.kernels.experts(C, static_cast<int64_t>(Fe), n / sources,
                                                     dtype_code(prec)))
            t += sources * *timed;
          else
            t += 2 * linear_fb_time(dev, prec, n, Fe, C) + linear_fb_time(dev, prec, n, C, Fe) +
                 stream_time(dev, 3 * 3 * ab * n * Fe);
        }
        r.sum += t;
        r.rows_sum += rows;
        if (t > w) {
          w = t;
          w_rows = rows;
        }
      }
      r.worst += w;
      r.worst_rows += w_rows;
    }
    for (double* v : {&r.worst, &r.worst_rows, &r.sum, &r.rows_sum})
      *v /= static_cast<double>(samples);
    cached = r;
    return *cached;
  };

  // --- compute of one micro-batch, forward + backward ---
  const RecomputeModules mods = layout.recompute_modules;
  for (int64_t l = 0; l < m.n_layers; ++l) {
    // Tensor parallelism splits heads (plan/attention_model.h) and FFN hidden sizes.
    s.attention += attention_time(dev, prec, m, l, B, T, tp, ab);
    // With sequence parallelism an all-gather before and a reduce-scatter after each TP block
    // (an all-reduce's traffic), forward and backward: 2 for attention, 2 for a dense FFN or
    // (Megatron) a shared expert; the routed experts run on the rank's own tokens. This trainer's
    // MoE layer (shared expert too) all-gathers its output and input gradient without SP: 1.
    const bool moe_layer = !m.is_dense_layer(l);
    const double tp_blocks =
        2 + (m.is_dense_layer(l) || (!trainer_tp && m.shared_expert_hidden > 0) ? 2 : 0) +
        (trainer_tp && moe_layer && !trainer_sp ? 1 : 0);
    if (tp > 1) p.comm.tp_count += tp_blocks;
    s.tensor_parallel += tp_blocks * tp_allreduce_s;
    // Two RMSNorms and two residual adds, forward (read + write) and backward (about twice);
    // on the rank's tokens only under this trainer's sequence parallelism.
    const double Ns = trainer_sp ? Nm : N;
    s.norms += rmsnorm_time(dev, Ns, C, 2, ab) + stream_time(dev, 3 * 2 * 3 * ab * Ns * C);
    // Selective layernorm recomputation runs the two norms' forwards again in backward: a third
    // of their forward + backward.
    if (mods.layernorm) s.norms += rmsnorm_time(dev, Ns, C, 2, ab) / 3;
    if (mods.mla_up_proj) s.attention += mla_up_proj_recompute_time(dev, prec, m, B, T, tp);
    if (m.is_dense_layer(l)) {
      const double Fd = static_cast<double>(m.dense_ffn_hidden() / tp);
      s.shared_expert += 2 * linear_fb_time(dev, prec, N, Fd, C) +
                         linear_fb_time(dev, prec, N, C, Fd) + stream_time(dev, 3 * 3 * ab * N * Fd);
      continue;
    }
    s.router += linear_fb_time(dev, DType::F32, Nm, E, C) + stream_time(dev, 3 * 2 * 4 * Nm * E);
    // Dispatch (gather rows) and combine (weighted scatter-add), forward and backward.
    s.norms += stream_time(dev, 2 * 2 * 2 * ab * Nm * K * C);
    if (m.shared_expert_hidden > 0) {
      const double Fs = static_cast<double>(m.shared_expert_hidden / tp);
      s.shared_expert += 2 * linear_fb_time(dev, prec, N, Fs, C) +
                         linear_fb_time(dev, prec, N, C, Fs) + stream_time(dev, 3 * 3 * ab * N * Fs);
    }
    // Experts: the EP group's ep·N·K assignments spread by the load model (capacity clips an
    // expert's rows); rank r holds experts [r·E/ep, (r+1)·E/ep). The slowest rank sets the step.
    const ExpertLoad& el = expert_load(l);
    const double worst = el.worst, sum = el.sum, worst_rows = el.worst_rows,
                 rows_sum = el.rows_sum;
    s.experts += worst;
    s.experts_mean += sum / static_cast<double>(ep);
    // Selective moe_act recomputation runs the experts' activation again in backward: read a
    // and b, write g, over each row's F / etp columns (the slowest rank's rows, and the mean's).
    if (mods.moe_act) {
      s.experts += stream_time(dev, 3 * ab * worst_rows * Fe);
      s.experts_mean += stream_time(dev, 3 * ab * rows_sum / static_cast<double>(ep) * Fe);
    }
    p.imbalance = std::max(p.imbalance, rows_sum > 0 ? worst_rows * ep / rows_sum : 1.0);
    // Four all-to-alls per layer (dispatch and combine, forward and backward). A rank sends its
    // rows bound elsewhere; the hot rank receives its share of the whole group's rows. With a
    // link per rank the hot rank's bytes set the time; over one link that all ranks share (the
    // calibrated a2a_receiver_bound towards 0) all ranks' bytes do, which at a given total is
    // the mean rank's send however the rows are spread.
    // Under ETP the exchange brings the hot rank 1 / etp of its experts' rows.
    const double row_bytes = C * bytes_of(parse_dtype(cfg.dist.a2a_dtype, "dist.a2a_dtype"));
    const double send = Nm * K * row_bytes * static_cast<double>(ep - 1) / static_cast<double>(ep);
    const double recv = worst_rows / static_cast<double>(etp) * row_bytes *
                        static_cast<double>(ep - 1) / static_cast<double>(ep);
    const double bound = cluster.a2a_receiver_bound;
    const double charged = send + bound * (std::max(send, recv) - send);
    const Collective a = exchange(charged);
    // Each exchange follows compute that differs between the ranks (their experts, their
    // tokens' routing): where measured, a late peer's cost is paid at each.
    s.a2a += 4 * (a.seconds() + (ep > 1 ? cluster.late_penalty : 0));
    p.a2a_kind = a.kind;
    if (ep > 1) {
      p.comm.a2a_exchanges += 4;
      p.comm.a2a_send_bytes += send;
      p.comm.a2a_hot_recv_bytes += recv;
      p.comm.a2a_charged_bytes += charged;
    }
    // ETP: the experts' rows all-gathered over the etp ranks of an expert before its GEMMs and
    // the partial outputs (F / etp columns each) reduce-scattered after, forward; the output
    // gradients all-gathered and the input gradients reduce-scattered, backward. Each pair moves
    // what one ring all-reduce of the hot rank's rows does, on the critical path.
    if (etp > 1) {
      const Collective pair = ring_allreduce(cluster, worst_rows * C * bytes_of(prec), etp,
                                             etp > cluster.devices_per_node);
      s.tensor_parallel += 2 * pair.seconds();
      p.comm.etp_count += 2;
      p.comm.expert_tensor_parallel_bytes += worst_rows * C * bytes_of(prec);
    }
  }
  // The exchange written out at the mean MoE layer (each form's time is linear in the bytes).
  CommBreakdown& cm = p.comm;
  if (cm.a2a_exchanges > 0) {
    const double layers = cm.a2a_exchanges / 4;
    cm.a2a_send_bytes /= layers, cm.a2a_hot_recv_bytes /= layers, cm.a2a_charged_bytes /= layers;
    cm.a2a_flat = alltoall(cluster, cm.a2a_charged_bytes, ep, false);
    cm.a2a_hierarchical = alltoall(cluster, cm.a2a_charged_bytes, ep, true);
    cm.a2a_deduplicated = alltoall_dedup(cluster, cm.a2a_charged_bytes, ep, dedup);
    cm.a2a_late_s = cluster.late_penalty;
    cm.a2a_runs = p.a2a_kind;
  }
  if (cm.etp_count > 0) {
    cm.expert_tensor_parallel_bytes /= cm.etp_count / 2;
    cm.expert_tensor_parallel = ring_allreduce(cluster, cm.expert_tensor_parallel_bytes, etp,
                                               etp > cluster.devices_per_node);
  }
  // The LM head and the cross-entropy (read logits forward, read and write them backward), on
  // the last stage.
  const double head = linear_fb_time(dev, prec, N, V / static_cast<double>(tp), C) +
                      stream_time(dev, 3 * ab * N * V / static_cast<double>(tp));
  // Full recomputation runs every layer's forward again in backward: a third more of the
  // layers' compute (forward + backward = 3 forwards), and the forward's two all-to-alls and
  // two TP all-reduces again (6 of each a layer instead of 4). MoE recomputation runs the
  // experts' up-projections again (W1·x and W3·x: two of the forward's three expert GEMMs, so
  // 2/9 more of the experts' forward + backward), no exchange.
  const Recompute recompute = recompute_mode(cfg, layout);
  if (recompute == Recompute::Full) {
    for (double* v : {&s.attention, &s.router, &s.experts, &s.experts_mean, &s.shared_expert,
                      &s.norms})
      *v *= 4.0 / 3.0;
    for (double* v : {&s.a2a, &s.tensor_parallel, &cm.a2a_exchanges, &cm.tp_count, &cm.etp_count})
      *v *= 1.5;
  } else if (recompute == Recompute::Moe) {
    for (double* v : {&s.experts, &s.experts_mean, &s.shared_expert}) *v *= 11.0 / 9.0;
  }
  // Pipelining: the stage that paces the pipeline (pacing_stage, plan/layout.h) runs its share of
  // the L layers, dense and MoE layers taken as spread evenly over the stages. A block's time as
  // priced counts its exchanges unless another micro-batch's compute hides them (--a2a-overlap).
  const double block = (s.attention + s.router + s.experts + s.shared_expert + s.norms +
                        (layout.a2a_overlap ? 0.0 : s.a2a) + s.tensor_parallel) /
                       static_cast<double>(m.n_layers);
  const PacingStage pace = pacing_stage(layout, m.n_layers, block, head);
  for (double* v : {&s.attention, &s.router, &s.experts, &s.experts_mean, &s.shared_expert,
                    &s.norms, &s.a2a, &s.tensor_parallel})
    *v *= pace.share;
  for (double* v : {&cm.a2a_exchanges, &cm.tp_count, &cm.etp_count})
    *v *= static_cast<double>(A) * pace.share;
  // Final norm, embedding gather and scatter-add.
  s.norms += rmsnorm_time(dev, N, C, 1, ab) + stream_time(dev, 3 * ab * N * C);
  if (pace.head) s.lm_head += head;
  // Its vocabulary split over the TP ranks: the input gradient joined backward (the split
  // cross-entropy's two row-sized sums are among the step's small collectives).
  if (tp > 1) {
    s.tensor_parallel += tp_allreduce_s;
    cm.tp_count += static_cast<double>(A);
  }
  if (p.a2a_kind.empty()) p.a2a_kind = "none";
  p.hierarchical_asked = cfg.dist.hierarchical;

  // Everything above is one micro-batch; the step runs A of them.
  for (double* v : {&s.attention, &s.router, &s.experts, &s.experts_mean, &s.shared_expert,
                    &s.norms, &s.lm_head, &s.a2a, &s.tensor_parallel})
    *v *= static_cast<double>(A);
  // Chunked all-to-all: while one chunk's rows travel, the experts compute another, so of the
  // (c − 1)/c of the traffic that has a neighbour chunk, min(comm, compute) is hidden.
  // Where the processes' threads fill the cores of a CPU, the communication thread that would
  // overlap takes a core from compute instead: nothing is hidden.
  const double c = static_cast<double>(std::max<int64_t>(1, cfg.dist.a2a_chunks));
  s.a2a_exposed =
      cluster.comm_shares_cores ? s.a2a : s.a2a - (c - 1) / c * std::min(s.a2a, s.experts);
  // Another micro-batch's compute beside the exchanges (--a2a-overlap): other_microbatch_hidden.
  const double overlap_hidden = other_microbatch_hidden(layout, s, A, cluster.comm_shares_cores);
  s.a2a_exposed -= overlap_hidden;
  // Replicas off their owner: weights out after the update and gradients back in backward, per
  // MoE layer of the stage (plan/placement_model.h), outside the chunked exchange.
  if (placed.replicas_off_owner > 0) {
    const double rep = 2 * static_cast<double>(m.n_moe_layers()) / static_cast<double>(layout.pp) *
                       alltoall(cluster, placed.replicas_off_owner * 3 * Fe * C * 4, ep,
                                cfg.dist.hierarchical)
                           .seconds();
    s.a2a += rep;
    s.a2a_exposed += rep;
  }

  // --- once per step: gradient reduction and the update ---
  const LocalParams lp = local_params(m, rl);
  const int64_t zero = zero_stage(cfg, layout);
  // The experts a step touches (plan/grad_model.h): the design's utilisation (activated experts
  // over all), and under grad.sparse_experts the share of its experts the busiest rank reduces
  // and steps.
  const ExpertActivity act =
      expert_activity(load, m, ep, N * static_cast<double>(layout.stage()), A,
                      cfg.grad.min_accum_fraction);
  p.experts_active = act.per_microbatch;
  const double kept = cfg.grad.sparse_experts ? act.busiest_rank : 1.0;
  const double grad_bytes = add_reductions(cfg, cluster, layout, lp, kept, cm);
  for (const auto& [name, r] : cm.reductions) s.grad_sync += r.seconds();
  // With overlap, buckets reduce while backward still runs (overlap_exposed).
  const double buckets = std::max(1.0, std::ceil(grad_bytes / (cfg.dist.bucket_mb * 1048576.0)));
  s.grad_sync_exposed = cfg.dist.overlap && !cluster.comm_shares_cores
                            ? overlap_exposed(s.grad_sync, buckets, backward_window(s))
                            : s.grad_sync;
  // Small collectives every step waits for, each a latency: per MoE layer and micro-batch the
  // balance statistics (aux and z loss) and, with EP, the routing counts; per step the
  // non-finite check and the gradient norm, the step's metrics (figures, loads, rank timing), and
  // the touched-expert counts (grad.sparse_experts) and expert loads (placement) where asked.
  if (layout.procs > 1) {
    const double per_mb = static_cast<double>(m.n_moe_layers()) * (2 + (ep > 1 ? 1 : 0)) /
                          static_cast<double>(layout.pp);
    const bool multi = layout.procs > cluster.devices_per_node;
    const double lat = multi ? cluster.inter_node_latency : cluster.intra_node_latency;
    const double asked = (cfg.grad.sparse_experts ? 1 : 0) + (placed.replicas_off_owner > 0 ? 1 : 0);
    const double xent = tp > 1 ? 2 : 0;  // the split cross-entropy's row maxima and sums
    s.sync = lat * ((per_mb + xent) * static_cast<double>(A) + 2 + kMetricCollectives + asked);
  }
  const UpdateCost update = update_cost(cfg, dev, lp, zero, kept);
  s.optimizer = update.seconds;

  // Processes that outnumber this machine's cores (as calibrated): the parts above are one
  // process computing alone. Over a fast transport the processes leave each exchange together
  // and compute together, a fair share of the cores each; over a slow shared link they leave it
  // one by one as the link serves them and compute in each other's waits. The calibration
  // measured the share of a core a process's compute gets, with even works, at several ratios
  // of compute (alone) to communication (plan/calibrate_comm.h); the run's ratio, its balanced
  // compute alone over its exposed communication, gives its share. The slowest rank's experts
  // are charged at that share too, as every part: the cores a lighter rank leaves while it
  // waits are not credited to it (docs/plan.md: tried, and why it is not kept).
  if (!cluster.compute_share.empty()) {
    const double comm = s.a2a_exposed + s.grad_sync_exposed + s.tensor_parallel + s.sync;
    const double balanced = s.compute() - s.experts + s.experts_mean;
    p.compute_share = compute_share(cluster, comm > 0 ? balanced / comm : HUGE_VAL);
    for (double* v : {&s.attention, &s.router, &s.experts, &s.experts_mean, &s.shared_expert,
                      &s.norms, &s.lm_head, &s.optimizer})
      *v /= p.compute_share;
  }

  // Offloaded optimizer state (dist.offload = host_file): a step reads and writes each state
  // float of the pieces it updates once, on the I/O thread beside the update, at the node's
  // disk bandwidth shared by the node's processes (not a share of the cores); the slower of the
  // two sets the phase.
  if (rl.offload == Offload::HostFile && cluster.disk_bandwidth > 0) {
    const double per_node = static_cast<double>(std::min(layout.procs, cluster.devices_per_node));
    const double disk_bytes = 2 * 4 * rl.state.slots * update.updated;
    s.optimizer = std::max(s.optimizer, disk_bytes * per_node / cluster.disk_bandwidth);
  }

  // Pipeline bubble: the schedule (layout.pipe_schedule()) timed pass by pass as the trainer
  // runs it (parallel/pipeline_schedule.h): a micro-batch's stage time split over the vp chunks
  // into forward, input-gradient and weight-gradient thirds (a backward is two forwards), and
  // each activation (or its gradient) priced as a send between stages. The bubble is the step
  // beyond the stage's own work: (pp − 1) micro-batch times under 1F1B and GPipe, (pp − 1) / vp
  // interleaved, less again where zero_bubble moves weight passes into the drain; plus the sends
  // on the fill's and the drain's path (those between busy passes overlap). The fill and the
  // drain run a micro-batch with no other beside it: its exchanges all exposed.
  if (layout.pp > 1) {
    const double per_mb = (s.compute() - s.optimizer - s.lm_head + s.a2a_exposed +
                           overlap_hidden + s.tensor_parallel) /
                          static_cast<double>(A);
    const PipeSchedule sched = layout.pipe_schedule();
    const PipeShape shape{layout.pp, A, layout.vp};  // valid: layout_problem above
    // Each TP rank sends its sequence-parallel share of the micro-batch's activations; in this
    // trainer without sequence parallelism, every rank the whole.
    cm.pipe_schedule = pipe_schedule_name(sched);
    const double send_share = trainer_tp && !trainer_sp ? 1.0 : static_cast<double>(tp);
    cm.pipeline_send =
        pipeline_send(cluster, N * C * ab / send_share, layout.procs / layout.pp);
    cm.pipe_sends = 2.0 * static_cast<double>(A * (layout.pp * layout.vp - 1)) /
                    static_cast<double>(layout.pp);
    const double third = per_mb / (3.0 * static_cast<double>(layout.vp));
    p.pipe_timeline = simulate(sched, shape, {third, third, third, cm.pipeline_send.seconds()});
    // Processes outnumbering a CPU's cores run the parts above at the all-busy share; a waiting
    // stage lends its cores, so where one stage's processes fill them no core idles: no bubble.
    const bool cores_lent = cluster.shared_cores > 0 && layout.procs > cluster.shared_cores &&
                            layout.procs / layout.pp >= cluster.shared_cores;
    const double idle = p.pipe_timeline.makespan - static_cast<double>(A) * per_mb;
    s.pipeline_bubble = cores_lent ? 0.0 : std::max(0.0, idle);
  }

  // What the exchanges and the reduction take from the compute they hide behind: their kernels
  // run on the device's multiprocessors too.
  s.comm_contention = dev.comm_compute_share *
                      ((s.a2a - s.a2a_exposed) + (s.grad_sync - s.grad_sync_exposed));
  p.step_time_s = s.compute() + s.a2a_exposed + s.grad_sync_exposed + s.tensor_parallel +
                  s.pipeline_bubble + s.sync + s.comm_contention;
  // Model FLOPs: every stage replica (stage() of them) runs the whole model on its samples.
  const double procs = static_cast<double>(layout.procs);
  p.flops_per_step = 3 * forward_flops(m, B, T).total() * static_cast<double>(A * layout.stage());
  p.flops_per_device_s = p.flops_per_step / (p.step_time_s * procs);
  p.mfu = p.flops_per_device_s / peak_of(dev, prec);
  p.tokens_per_s = N * static_cast<double>(A * layout.stage()) / p.step_time_s;
  p.utilisation = (s.compute() - s.experts + s.experts_mean) / p.step_time_s;
  const double comm = s.a2a + s.grad_sync + s.tensor_parallel;
  if (!reference && comm > 0) {
    ClusterSpec ideal = cluster;
    ideal.intra_node_latency = ideal.inter_node_latency = 0;
    const Prediction r = predict_impl(cfg, ideal, layout, uniform_load(m.n_experts), true);
    p.comm_efficiency = (r.parts.a2a + r.parts.grad_sync + r.parts.tensor_parallel) / comm;
  }
  p.memory = memory_per_device(cfg, layout, dev.threads == 0);
  p.fits = dev.memory_bytes <= 0 || p.memory.total() <= dev.memory_bytes;
  return p;
}

}  // namespace

Prediction predict(const RunConfig& cfg, const ClusterSpec& cluster, const Layout& layout,
                   const LoadModel& load) {
  return predict_impl(cfg, cluster, layout, load, false);
}

}  // namespace moetrain::plan
