// The expert all-to-all (parallel/alltoall.h) against raw MPI_Alltoallv moving the same bytes, in
// the same run. One iteration = dispatch + combine of N·K routed rows of C floats per rank:
//   ours      a2a_plan (per-expert count exchange) + a2a_dispatch + a2a_combine, flat route
//   ours_2d   the same over the two-stage route (--ranks-per-node, default P/2 when P ≥ 4)
//   raw       two MPI_Alltoallv calls (there and back) with the byte counts of the same plan
// Each figure is the median over repetitions of the slowest rank's time; ratio = ours / raw
// (target ≤ 1.15). Routing is uniform over E = 4·P experts, top-2, from a fixed seed.
//   mpiexec -n 2 build/bench/bench_alltoall [--reps 30] [--ranks-per-node L]
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/threads.h"
#include "core/timer.h"
#include "parallel/alltoall.h"
#include "parallel/runtime.h"

using namespace moetrain;

namespace {

double slowest(double seconds) {
  double out = 0;
  MPI_Allreduce(&seconds, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median over reps of the slowest rank's time of f, after warm-up; the fs run interleaved so
// that drift on a shared machine hits all of them alike.
std::vector<double> time_interleaved(const std::vector<std::function<void()>>& fs, int reps) {
  std::vector<std::vector<double>> t(fs.size());
  for (int rep = -3; rep < reps; ++rep) {
    for (std::size_t i = 0; i < fs.size(); ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      Timer timer;
      fs[i]();
      double s = slowest(timer.seconds());
      if (rep >= 0) t[i].push_back(s);
    }
  }
  std::vector<double> out;
  for (auto& v : t) out.push_back(median(v));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int reps = 30, per_node = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--ranks-per-node") == 0) per_node = std::atoi(argv[i + 1]);
  }
  init_threads(0, dist_local_size());
  auto group = dist_world("bench_a2a");
  const int P = group->size(), r = group->rank();
  if (per_node < 0) per_node = P >= 4 ? P / 2 : 1;
  A2aHierarchy hier = make_a2a_hierarchy(*group, per_node);
  const A2aRoute flat{group.get()}, two_d = hier.route(*group);
  MPI_Comm raw_comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw_comm);

  if (r == 0)
    std::printf("ranks %d, 2-D route %d x %d, median of %d\n%8s %6s %10s %10s %10s %10s %8s %8s\n",
                P, hier.inter->size(), hier.intra->size(), reps, "tokens", "C", "MiB/rank",
                "raw_ms", "ours_ms", "ours2d_ms", "ratio", "ratio2d");
  const int64_t K = 2, E = 4 * P;
  for (int64_t N : {256, 2048, 8192}) {
    for (int64_t C : {256, 1024}) {
      // Each routed row picks an expert uniformly (from the rank's own stream).
      Rng rng(7,
              rng_stream(RngPurpose::Test, static_cast<uint64_t>(N * C), static_cast<uint64_t>(r)));
      std::vector<int64_t> counts(E, 0);
      for (int64_t i = 0; i < N * K; ++i)
        ++counts[rng.below(static_cast<uint64_t>(i), static_cast<uint64_t>(E))];
      std::vector<float> x(static_cast<std::size_t>(N * K * C));
      rng_fill_uniform(x.data(), static_cast<int64_t>(x.size()), rng, -1.0f, 1.0f);
      A2aLayout plan, plan2;
      a2a_plan(plan, flat, counts.data(), E, C);
      std::vector<float> xr(static_cast<std::size_t>(plan.R_recv * C)), back(x.size()),
          raw_recv(xr.size());
      A2aScratch scratch;
      // Raw: the same byte counts as the plan, there and back.
      std::vector<int> sc(P), sd(P), rc(P), rd(P);
      for (int q = 0, s = 0, t = 0; q < P; ++q) {
        sc[q] = static_cast<int>(plan.send_rows[q] * C), sd[q] = s, s += sc[q];
        rc[q] = static_cast<int>(plan.recv_rows[q] * C), rd[q] = t, t += rc[q];
      }
      auto ours = [&] {
        a2a_plan(plan, flat, counts.data(), E, C);
        a2a_dispatch(xr.data(), x.data(), plan, flat, scratch);
        a2a_combine(back.data(), xr.data(), plan, flat, scratch);
      };
      auto ours2d = [&] {
        a2a_plan(plan2, two_d, counts.data(), E, C);
        a2a_dispatch(xr.data(), x.data(), plan2, two_d, scratch);
        a2a_combine(back.data(), xr.data(), plan2, two_d, scratch);
      };
      auto raw = [&] {
        MPI_Alltoallv(x.data(), sc.data(), sd.data(), MPI_FLOAT, raw_recv.data(), rc.data(),
                      rd.data(), MPI_FLOAT, raw_comm);
        MPI_Alltoallv(raw_recv.data(), rc.data(), rd.data(), MPI_FLOAT, back.data(), sc.data(),
                      sd.data(), MPI_FLOAT, raw_comm);
      };
      std::vector<double> t = time_interleaved({raw, ours, ours2d}, reps);
      if (std::memcmp(back.data(), x.data(), x.size() * sizeof(float)) != 0) {
        std::fprintf(stderr, "rank %d: rows did not come back intact\n", r);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      if (r == 0)
        std::printf("%8lld %6lld %10.2f %10.3f %10.3f %10.3f %8.3f %8.3f\n",
                    static_cast<long long>(N), static_cast<long long>(C),
                    static_cast<double>(N * K * C * 4) / (1 << 20), t[0] * 1e3, t[1] * 1e3,
                    t[2] * 1e3, t[1] / t[0], t[2] / t[0]);
    }
  }
  MPI_Comm_free(&raw_comm);
  group.reset();
  hier = A2aHierarchy{};
  MPI_Finalize();
  return 0;
}
