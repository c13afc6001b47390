#include "train/parallel_setup.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/check.h"
#include "core/dtype.h"
#include "parallel/comm_on_thread.h"
#include "parallel/mpi_reducer.h"
#include "parallel/grad_sync.h"
#include "parallel/zero2_reducer.h"

namespace moetrain {

MoeContext RunParallel::moe_context() {
  return groups->layout.world > 1 ? ep.context(*groups) : MoeContext{};
}

RunParallel make_run_parallel(Comm& world, const DistSettings& dist, int64_t n_experts,
                              bool has_moe_layers) {
  RunParallel out;
  // dist.pp > 1: the groups are those of this rank's stage's copies (one per pipeline), made by
  // make_process_groups over them as over the world of a run without stages: the stage's dense
  // gradients reduce over its copies, its experts shard over EP groups of its copies and their
  // gradients reduce over the stage's EDP groups. control stays the world, so that losses, norms
  // and stop votes are agreed over every stage.
  // Ranks in Megatron's order, tensor-parallel rank fastest: r = (replica · pp + stage) · tp + t.
  // A tensor-parallel group is the neighbours of one (replica, stage); a pipe the ranks of one
  // (replica, t), ordered by stage (each TP rank sends its own copy of the activation, the same
  // on every rank of its group, to the peer with its t); a stage's copies are every rank of the
  // stage, all of which hold MoE tokens.
  const int W = world.size(), T = static_cast<int>(dist.tp), P = static_cast<int>(dist.pp);
  MOETRAIN_CHECK(T >= 1 && W % T == 0,
                 "dist.tp = {} tensor-parallel ranks need a multiple of {} processes, and this "
                 "run has {}: start it with `moetrain launch -n {} -- train ...`",
                 T, T, W, T);
  const int t = world.rank() % T;
  Comm* over = &world;
  std::unique_ptr<Comm> copies;
  if (P > 1) {
    MOETRAIN_CHECK(W % (P * T) == 0,
                   "dist.pp = {} pipeline stages{} need a multiple of {} processes, and this run "
                   "has {}: start it with `moetrain launch -n {} -- train ...` (or `mpirun -n {} "
                   "moetrain train ...`)",
                   P, T > 1 ? fmt::format(" of dist.tp = {} ranks each", T) : "", P * T, W,
                   P * T, P * T);
    // Expert parallelism runs inside a stage: its copies (one per pipeline and tensor-parallel
    // rank) form EP groups as the processes of a run without stages do.
    MOETRAIN_CHECK((W / P) % dist.ep == 0,
                   "dist.ep = {} does not divide the {} processes of a pipeline stage (dist.pp = "
                   "{} over {} processes): each stage's copies form the expert-parallel groups; "
                   "use a dist.ep that divides {}",
                   dist.ep, W / P, P, W, W / P);
    const int stage = (world.rank() / T) % P, replica = world.rank() / (T * P);
    copies = world.split(stage, replica * T + t, {"stage"});
    over = copies.get();
    out.pipe.stages = P, out.pipe.stage = stage;
    out.pipe.schedule = parse_pipe_schedule(dist.pp_schedule, "dist.pp_schedule");
    out.pipe.chunks_per_stage = dist.vp;
    out.pipe.comm = world.split(replica * T + t, stage, {"pipe"});
    out.pipe.replica = replica, out.pipe.replicas = W / (P * T);
  }
  std::unique_ptr<Comm> tp;
  // Tensor parallelism: every rank holds tokens for the MoE layers (a tensor-parallel group's
  // ranks route a share of its batch each), so the process groups are the world's (the stage's
  // copies under dist.pp), as for data-parallel copies.
  if (T > 1) tp = world.split(world.rank() / T, t, {"tensor"});
  if (T > 1 && dist.local_steps()) {
    out.local.grads = world.split(world.rank() / T, t, {"copy_grads"});
    out.local.check = world.split(world.rank() / T, t, {"copy_check"});
    out.local.replicas = world.split(t, world.rank() / T, {"replicas"});
  }
  // Expert tensor parallelism folds EP × ETP over the same ranks (groups.h).
  out.groups = std::make_unique<ProcessGroups>(
      make_process_groups(*over, static_cast<int>(dist.ep), static_cast<int>(dist.etp)));
  if (copies) out.groups->control = world.dup("control");
  const ParallelLayout& pl = out.groups->layout;
  out.experts = {0, n_experts};
  if (pl.world == 1) {
    out.tp = std::move(tp);
    out.pipe.tp = out.tp.get();
    return out;
  }
  if (has_moe_layers) out.experts = expert_shard(n_experts, pl.ep, pl.ep_index);
  // dist.ranks_per_node counts a node's processes. Under stages the exchange runs over a stage's
  // copies (world rank = pipeline · P + stage), of which a node holds R / P when it holds whole
  // pipelines, and one when a pipeline spans nodes (validate_pipeline refuses the rest).
  int64_t ranks_per_node = dist.ranks_per_node;
  if (dist.pp > 1 && ranks_per_node > 0)
    ranks_per_node = ranks_per_node % dist.pp == 0 ? ranks_per_node / dist.pp : 1;
  ExpertParallelOptions epo{.hierarchical = dist.hierarchical,
                            .ranks_per_node = static_cast<int>(ranks_per_node),
                            .chunks = static_cast<int>(dist.a2a_chunks),
                            .wire = parse_dtype(dist.a2a_dtype, "dist.a2a_dtype"),
                            .overlap = dist.overlap,
                            .adaptive = std::nullopt};
  if (dist.adaptive_route) {
    RouteChoiceOptions route;
    route.probe_every = dist.route_probe_every;
    route.start_relayed = dist.hierarchical;
    epo.adaptive = route;
  }
  out.ep = make_expert_parallel(epo, *out.groups);
  if (tp)
    out.tp = out.ep.comm_thread ? comm_on_thread(std::move(tp), *out.ep.comm_thread) : std::move(tp);
  out.pipe.tp = out.tp.get();
  return out;
}

namespace {

// The ranges inside the stage's ranges (whole when unset): a stage's bounds are tensor bounds,
// but the dense ranges run across tensors and are cut there. The stage's ranges are ascending and
// disjoint, so the cut ranges stay in ascending order.
SyncRanges within(SyncRanges r, const std::optional<std::vector<FlatRange>>& stage) {
  if (!stage) return r;
  auto cut = [&](const std::vector<FlatRange>& in) {
    std::vector<FlatRange> out;
    for (const FlatRange& f : in)
      for (const FlatRange& s : *stage) {
        const int64_t a = std::max(f.offset, s.offset);
        const int64_t z = std::min(f.offset + f.size, s.offset + s.size);
        if (a < z) out.push_back({a, z - a});
      }
    return out;
  };
  r.dense = cut(r.dense), r.expert = cut(r.expert);
  std::erase_if(r.expert_keyed, [&](const ExpertPiece& p) {
    return std::none_of(stage->begin(), stage->end(), [&](const FlatRange& s) {
      return p.offset >= s.offset && p.offset + p.size <= s.offset + s.size;
    });
  });
  return r;
}

}  // namespace

ReduceSettings reduce_settings(const DistSettings& dist, CommThread* comm_thread) {
  ReduceSettings rs;
  rs.bucket_first_mb = dist.bucket_first_mb;
  rs.bucket_mb = dist.bucket_mb;
  rs.grad_reduce_dtype = dist.grad_reduce_dtype;
  rs.zero = dist.zero;
  rs.local_steps = dist.local_steps();
  rs.overlap = dist.overlap ? comm_thread : nullptr;
  return rs;
}

DataParallel make_data_parallel(const ParamTable& layout, const ExpertShard& held,
                                ProcessGroups& groups, const ReduceSettings& settings) {
  DataParallel out;
  if (groups.layout.world == 1) {
    out.reducer = std::make_unique<LocalGradReducer>(layout.size());
    for (const FlatRange& r :
         settings.stage.value_or(std::vector<FlatRange>{{0, layout.size()}}))
      out.pieces.push_back({r.offset, r.size});
    return out;
  }
  const SyncRanges ranges = within(sync_ranges(layout, held), settings.stage);
  GradSyncConfig gc;
  gc.first_bucket_bytes = static_cast<int64_t>(settings.bucket_first_mb * 1024 * 1024);
  gc.bucket_bytes = static_cast<int64_t>(settings.bucket_mb * 1024 * 1024);
  gc.wire = parse_grad_wire(settings.grad_reduce_dtype, "dist.grad_reduce_dtype");
  gc.sparse_experts = settings.sparse_experts;
  gc.sparse_ratio = settings.sparse_ratio;
  const bool zero3 = settings.zero == 3;
  if (zero3) gc.unit_starts = settings.unit_starts;
  if (settings.local_steps && !settings.copy) {
    // Each rank steps on its own gradients over what it holds; GradSync's groups average.
    out.reducer = std::make_unique<LocalGradReducer>(layout.size());
    for (const FlatRange& r : ranges.dense) out.pieces.push_back({r.offset, r.size});
    for (const FlatRange& r : ranges.expert) out.pieces.push_back({r.offset, r.size});
    out.averager = std::make_unique<ParamAverager>(ranges, *groups.grads, *groups.expert_grads);
    return out;
  }
  if (settings.copy) {
    // Local steps of tensor-parallel copies: a copy sums its ranks' shares over its group (the
    // reduction below, without ZeRO, which local steps refuse) and averages over the ranks
    // holding the same shard in the other copies.
    MOETRAIN_CHECK(settings.replicas != nullptr, "local steps of tensor-parallel copies need "
                                                 "the replicas' communicator");
    out.averager =
        std::make_unique<ParamAverager>(ranges, *settings.replicas, *settings.replicas);
  }
  auto sync = std::make_unique<GradSync>(ranges, settings.copy ? *settings.copy : *groups.grads,
                                         settings.copy ? *settings.copy : *groups.expert_grads, gc);
  out.buckets = static_cast<int64_t>(sync->buckets().size());
  if (settings.zero >= 2) {
    MOETRAIN_CHECK(settings.grad_buffer != nullptr, "ZeRO-2/3 needs the flat gradient buffer");
    auto reducer = std::make_unique<Zero2Reducer>(std::move(sync), settings.overlap,
                                                  *settings.grad_buffer, zero3);
    if (zero3) {
      MOETRAIN_CHECK(settings.param_buffer != nullptr, "ZeRO-3 needs the flat parameter buffer");
      out.zero3 = std::make_unique<Zero3Params>(reducer->sync(), settings.param_buffer,
                                                layout.size(), settings.unit_starts,
                                                settings.overlap);
    }
    out.pieces = reducer->pieces();
    if (settings.overlap) {
      Zero2Reducer* r = reducer.get();
      out.grads_ready = [r](int64_t from) { r->ready(from); };
    }
    out.reducer = std::move(reducer);
    return out;
  }
  const bool zero1 = settings.zero == 1;
  if (zero1) {
    for (const ShardPiece& p : sync->shard_pieces())
      out.pieces.push_back({p.range.offset, p.range.size});
  } else {
    for (const FlatRange& r : ranges.dense) out.pieces.push_back({r.offset, r.size});
    for (const FlatRange& r : ranges.expert) out.pieces.push_back({r.offset, r.size});
  }
  auto reducer =
      std::make_unique<MpiGradReducer>(std::move(sync), settings.overlap, zero1);
  if (settings.overlap) {
    MpiGradReducer* r = reducer.get();
    out.grads_ready = [r](int64_t from) { r->ready(from); };
  }
  out.reducer = std::move(reducer);
  return out;
}

std::vector<int> checkpoint_writers(const ParamTable& layout, const ParallelLayout& pl, int64_t E) {
  const std::vector<ParamInfo>& params = layout.params();
  std::vector<int> writer(params.size(), 0);
  std::vector<int64_t> bytes(static_cast<std::size_t>(pl.world), 0);
  std::vector<std::size_t> replicated;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamInfo& p = params[i];
    if (p.expert < 0) {
      replicated.push_back(i);
      continue;
    }
    const int ep_index = static_cast<int>(p.expert / (E / pl.ep));
    const int dp_index = static_cast<int>(p.expert % pl.dp);
    writer[i] = pl.rank_of(ep_index, dp_index);
    bytes[writer[i]] += p.numel;
  }
  std::stable_sort(replicated.begin(), replicated.end(),
                   [&](std::size_t a, std::size_t b) { return params[a].numel > params[b].numel; });
  for (std::size_t i : replicated) {
    writer[i] = static_cast<int>(std::min_element(bytes.begin(), bytes.end()) - bytes.begin());
    bytes[writer[i]] += params[i].numel;
  }
  return writer;
}

}  // namespace moetrain
