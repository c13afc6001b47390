// Load balancing on a skewed workload: the MoE layer's forward + backward under expert
// parallelism (EP = every process, experts sharded contiguously, so the hot experts share rank 0)
// with a router whose token → expert traffic follows a Zipf law. The gate gives expert e the
// logit offset ln p_e, p_e ∝ (e + 1)^−1.2, plus a random token-dependent part of unit scale, so
// top-1 choices land roughly Zipf-distributed and the top-2 load is skewed toward experts 0, 1.
// Variants:
//   fixed          capacity_factor 1.25 (tokens over capacity are dropped)
//   dynamic        the [balance] controller moves cf each iteration from the reduced
//                  utilisation and imbalance (model.capacity = dynamic), starting at 1.25
//   group_limited  route_groups = processes, route_group_topk = 1: each token stays within one
//                  rank's experts (dropless)
//   all            dynamic and group-limited together
//   static         dropless, static contiguous placement: the reference for replicated
//   replicated     dropless, placement.spare_slots = 1 re-planned every 2 iterations from the
//                  loads' moving average (decay 0.5); its time includes summing the replicas'
//                  gradients into their owners and refreshing the replicas' weights
//   all_replicated dynamic, group-limited and replicated together (the groups are the static
//                  placement's ranks; replicas then spread a group's tokens over other ranks)
// Every process runs the same fixed number of iterations (a collective per iteration); the
// iteration time is the slowest process's (manual time). Counters:
//   rank_max_mean   max / mean of the rows each rank's experts (or slots) computed in the last
//                   iteration (1 = balanced)
//   expert_util     share of experts that computed at least one row
//   capacity_util   rows computed / capacity slots (1 when dropless)
//   dropped         share of assignments dropped for capacity
//   cf              the capacity factor in effect at the last iteration (0 = dropless)
// Step time shows imbalance only where each rank has a core of its own:
//   OMP_NUM_THREADS=1 mpiexec -n 2 --bind-to core build/bench/bench_balance
// and the load figures on 4 ranks (their times are meaningless on fewer than 4 cores):
//   OMP_NUM_THREADS=1 mpiexec -n 4 --oversubscribe build/bench/bench_balance
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string_view>
#include <vector>

#include "core/rng.h"
#include "moe/capacity_controller.h"
#include "moe/moe_layer.h"
#include "moe/placement.h"
#include "parallel/groups.h"
#include "parallel/mpi_exchange.h"
#include "parallel/replica_sync.h"
#include "parallel/runtime.h"

using namespace moetrain;

namespace {

constexpr int64_t kC = 128, kF = 256, kE = 8, kK = 2, kTokens = 2048;  // tokens per rank
constexpr double kZipf = 1.2;
constexpr float kCf = 1.25f;

struct Variant {
  bool dynamic = false, grouped = false, dropless = false, replicate = false;
};

void BM_Balance(benchmark::State& state, Variant v) {
  auto world = dist_world("bench_balance");
  const int P = world->size(), r = world->rank();
  ProcessGroups groups = make_process_groups(*world, P);
  MoeConfig cfg;
  cfg.C = kC, cfg.F = kF, cfg.E = kE, cfg.K = kK;
  cfg.aux_loss_coef = 0, cfg.z_loss_coef = 0;
  cfg.capacity_factor = (v.grouped && !v.dynamic) || v.dropless ? 0.0f : kCf;
  if (v.grouped && P > 1 && kE % P == 0) cfg.route_groups = P, cfg.route_group_topk = 1;
  MoeParamSizes sizes = moe_param_sizes(cfg);
  std::vector<float> params(sizes.total()), grads(sizes.total(), 0.0f);
  rng_fill_normal(params.data(), sizes.total(), Rng(1, 1), 0.0f, 0.05f);
  MoeWeights w = moe_weights_from_buffer(cfg, params.data()),
             g = moe_weights_from_buffer(cfg, grads.data());
  // Channel 0 of every token is 1 and carries the Zipf offsets; the rest of the gate is random
  // with rows of unit norm against unit-variance inputs.
  for (int64_t e = 0; e < kE; ++e) {
    float* row = w.gate + e * kC;
    rng_fill_normal(row, kC, Rng(2, static_cast<uint64_t>(e)), 0.0f,
                    static_cast<float>(1.0 / std::sqrt(double(kC))));
    row[0] = static_cast<float>(-kZipf * std::log(double(e + 1)));
  }
  std::vector<float> x(kTokens * kC), dout(kTokens * kC), out(kTokens * kC), dinp(kTokens * kC);
  rng_fill_normal(x.data(), kTokens * kC, Rng(3, static_cast<uint64_t>(r)), 0.0f, 1.0f);
  rng_fill_normal(dout.data(), kTokens * kC, Rng(4, static_cast<uint64_t>(r)), 0.0f, 1.0f);
  for (int64_t t = 0; t < kTokens; ++t) x[t * kC] = 1.0f;

  MpiExchange exchange(A2aRoute{groups.a2a.get()}, MpiExchangeOptions{});
  MoeLayer layer(cfg, {&exchange, groups.moe_stats.get()});
  CapacityController controller(CapacityControlConfig{}, kCf);
  PlacementPlanner planner({.spare_slots = v.replicate ? 1 : 0, .every = 2, .decay = 0.5}, 1, kE,
                           P, 0);
  ReplicaSync sync(*groups.a2a, cfg);
  int64_t iteration = 0;
  MoeStep step;
  std::vector<int64_t> load(kE);
  double rank_max_mean = 0, expert_util = 0, capacity_util = 0, dropped = 0;
  for (auto _ : state) {
    world->barrier();
    const double t0 = MPI_Wtime();
    layer.forward(out.data(), x.data(), kTokens, w, step);
    layer.backward(dinp.data(), dout.data(), w, g, 1.0f);
    if (layer.placement()) sync.reduce_grads(*layer.placement(), g);
    double dt = MPI_Wtime() - t0;
    world->allreduce(&dt, 1, {.op = ReduceOp::Max});
    state.SetIterationTime(dt);

    const MoeStats& s = layer.stats();
    std::copy(s.tokens_per_expert.begin(), s.tokens_per_expert.end(), load.begin());
    int64_t figures[3] = {s.assignments, s.dropped, s.capacity > 0 ? kE * s.capacity : 0};
    world->allreduce(load.data(), kE);
    world->allreduce(figures, 3);
    const std::vector<int64_t> rows = world->allgather_one(layer.received_rows());
    int64_t total = 0, used = 0, max_expert = 0;
    for (int64_t e = 0; e < kE; ++e)
      total += load[e], used += load[e] > 0, max_expert = std::max(max_expert, load[e]);
    int64_t rows_sum = 0;
    for (int64_t n : rows) rows_sum += n;
    rank_max_mean = rows_sum > 0 ? static_cast<double>(*std::max_element(rows.begin(), rows.end())) *
                                       P / static_cast<double>(rows_sum)
                                 : 1.0;
    expert_util = static_cast<double>(used) / kE;
    capacity_util = figures[2] > 0 ? static_cast<double>(total) / figures[2] : 1.0;
    dropped = figures[0] > 0 ? static_cast<double>(figures[1]) / figures[0] : 0.0;
    if (v.dynamic) {
      const double imbalance = total > 0 ? double(max_expert) * kE / double(total) : 1.0;
      controller.update(capacity_util, imbalance);
      layer.set_capacity_factor(static_cast<float>(controller.cf()));
    }
    if (v.replicate) {
      planner.observe(0, load.data());
      if (planner.due(++iteration)) {
        planner.replan(0);
        layer.set_placement(&planner.placement(0));
      }
      if (layer.placement()) {
        world->barrier();
        const double r0 = MPI_Wtime();
        sync.refresh(*layer.placement(), w);
        double dr = MPI_Wtime() - r0;
        world->allreduce(&dr, 1, {.op = ReduceOp::Max});
        state.SetIterationTime(dr);  // adds to the iteration's time
      }
    }
  }
  auto& c = state.counters;
  c["rank_max_mean"] = rank_max_mean;
  c["expert_util"] = expert_util;
  c["capacity_util"] = capacity_util;
  c["dropped"] = dropped;
  c["cf"] = layer.config().capacity_factor;
  c["ranks"] = P;
}

// Only rank 0 prints; the others run the same benchmarks so that the collectives match.
class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // A fixed iteration count: Google Benchmark's own choice could differ between processes.
  for (const auto& [name, v] : {std::pair{"balance/fixed_cf", Variant{}},
                                std::pair{"balance/dynamic_cf", Variant{true, false}},
                                std::pair{"balance/group_limited", Variant{false, true}},
                                std::pair{"balance/all", Variant{true, true}},
                                std::pair{"balance/static", Variant{.dropless = true}},
                                std::pair{"balance/replicated",
                                          Variant{.dropless = true, .replicate = true}},
                                std::pair{"balance/all_replicated",
                                          Variant{true, true, false, true}}})
    benchmark::RegisterBenchmark(name, BM_Balance, v)
        ->Iterations(30)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  bool file_out = false;
  for (int i = 1; i < argc; ++i)
    file_out |= std::string_view(argv[i]).starts_with("--benchmark_out=");
  benchmark::Initialize(&argc, argv);
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    NullReporter quiet, quiet_file;  // --benchmark_out is rank 0's file alone
    if (file_out)
      benchmark::RunSpecifiedBenchmarks(&quiet, &quiet_file);
    else
      benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
