#include "plan/calibrate_comm.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "core/check.h"
#include "core/timer.h"
#include "io/file.h"
#include "kernels/gemm.h"
#include "parallel/comm_thread.h"
#include "parallel/supervisor.h"

namespace moetrain::plan {

namespace {

// Seconds per call of `task` run on the communication thread (post, then wait, as the trainer's
// exchanges do), the median of `reps`, the slowest rank's.
// `late` > 0: every rank but 0 posts that many seconds after the barrier, as ranks arrive when
// their compute ends; rank 0's time is counted from when they post.
template <class F>
double time_collective(Comm& world, CommThread& thread, F&& task, int reps, double late = 0) {
  thread.wait(thread.post(task));  // warm-up: connections, buffers
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    world.barrier();
    Timer timer;
    if (late > 0 && world.rank() != 0)
      std::this_thread::sleep_until(std::chrono::steady_clock::now() +
                                    std::chrono::duration<double>(late));
    thread.wait(thread.post(task));
    t.push_back(std::max(0.0, timer.seconds() - late));
  }
  std::sort(t.begin(), t.end());
  double med = t[t.size() / 2];
  world.allreduce(&med, 1, {.op = ReduceOp::Max});
  return med;
}

// The compute share of oversubscribed processes (CommFigures::share): rounds in which each rank
// computes one-thread GEMMs (w seconds of them alone) and then posts `exchange` (the config's
// all-to-all, t_x seconds on time) to the communication thread and waits for it, as the
// trainer's step alternates the two; w = 1/4, 1, 4 and 16 × t_x. A round takes t_x plus its
// compute at the share the processes get: share = w / (round − t_x), the form the cost model
// charges. What the GEMMs cost alone is not taken from a separate timing (one rank timing them
// while the others wait reads ±15% from batch to batch here, and that error would scale every
// share): at the largest ratio the processes compute together for all but a seventeenth of
// the round, so its cost per call is taken as the fair share's, cores / P of a core; the other
// ratios are measured against it. A rough timing alone only sizes the rounds. The cost per call
// is the mean over the ranks.
template <class F>
void measure_shares(Comm& world, CommThread& thread, F&& exchange, double t_x, CommFigures& f) {
  const int P = world.size();
  // The work: a one-thread f32 GEMM of 192³ (0.44 MB of operands, in a core's L2), what the
  // trainer's one-thread compute is made of.
  constexpr int64_t kDim = 192;
  std::vector<float> a(kDim * kDim, 0.5f), b(a.size(), 0.25f), c(a.size());
  const auto unit = [&] {
    gemm(Trans::N, Trans::N, kDim, kDim, kDim, a.data(), b.data(), c.data(), false);
  };
  // A barrier waited for as the trainer waits: on the communication thread, which polls
  // politely, so that a waiting rank leaves the cores to the others.
  const auto polite_barrier = [&] { thread.wait(thread.post([&] { world.barrier(); })); };
  // The rough timing alone, for the rounds' sizes: rank 0 while the others wait.
  double guess = 0;
  polite_barrier();
  if (world.rank() == 0) {
    unit();
    Timer timer;
    for (int i = 0; i < 40; ++i) unit();
    guess = timer.seconds() / 40;
  }
  polite_barrier();
  world.allreduce(&guess, 1, {.op = ReduceOp::Max});  // every rank runs the same calls
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  // The ratios' rounds are chosen first, then timed in three passes over all of them, each
  // ratio's cost the median of its passes: every ratio is read against the largest, and the
  // machine's speed drifts over the seconds this takes (ratio after ratio, one pass each, the
  // share at ratio 4 read 0.37 to 0.71 from one calibration to the next, where even works over
  // shared memory get half a core).
  std::vector<int64_t> calls_at;
  std::vector<int> rounds_at;
  for (const double r : {0.25, 1.0, 4.0, 16.0}) {
    const int64_t calls = std::max<int64_t>(1, std::llround(r * t_x / guess));
    if (!calls_at.empty() && calls == calls_at.back()) continue;  // a fast exchange
    // About 0.5 s of rounds a pass at the fair share, at least one a pass (so at least three in
    // all, for the scheduler's time slices to average out over a fast exchange); a ratio whose
    // 3 rounds would take over 6 s is left out (a very slow link's largest ratio: the largest
    // measured is then the reference).
    const double round_s = t_x + static_cast<double>(calls) * guess * P / cores;
    if (3 * round_s > 6.0) break;
    calls_at.push_back(calls);
    rounds_at.push_back(static_cast<int>(std::clamp(std::ceil(0.5 / round_s), 1.0, 1000.0)));
  }
  std::vector<std::vector<double>> costs(calls_at.size());
  for (int pass = 0; pass < 3; ++pass) {
    for (std::size_t i = 0; i < calls_at.size(); ++i) {
      thread.wait(thread.post(exchange));  // warm-up round: the ranks leave it together
      Timer timer;
      for (int round = 0; round < rounds_at[i]; ++round) {
        for (int64_t c = 0; c < calls_at[i]; ++c) unit();
        thread.wait(thread.post(exchange));
      }
      double cost = (timer.seconds() / rounds_at[i] - t_x) / static_cast<double>(calls_at[i]);
      world.allreduce(&cost, 1);
      costs[i].push_back(cost / P);
    }
  }
  std::vector<double> per_call;  // seconds per call beyond the exchange, mean over the ranks
  for (auto& c : costs) {
    std::sort(c.begin(), c.end());
    per_call.push_back(c[1]);
  }
  if (per_call.empty() || per_call.back() <= 0) return;
  const double alone = per_call.back() * cores / P;  // a call's cost at a whole core
  for (std::size_t i = 0; i < per_call.size(); ++i) {
    f.share_ratio.push_back(static_cast<double>(calls_at[i]) * alone / t_x);
    f.share.push_back(per_call[i] > 0 ? std::min(1.0, alone / per_call[i]) : 1.0);
  }
}

}  // namespace

CommFigures measure_comm(Comm& world, int64_t grad_bytes, int64_t a2a_bytes) {
  const int P = world.size();
  MOETRAIN_CHECK(P >= 2, "plan --calibrate-comm needs at least 2 processes (it has {})", P);
  CommFigures f;
  f.procs = P;
  CommThread thread;
  // Latency: the small collectives of a step (routing counts, balance statistics, metrics).
  int64_t one = 1;
  f.latency = time_collective(world, thread, [&] { world.allreduce(&one, 1); }, 200);
  // All-to-all: a rank sends a2a_bytes spread evenly over the others, as the expert exchange does.
  {
    const int64_t per_peer = std::max<int64_t>(1, a2a_bytes / (P - 1));
    std::vector<int64_t> counts(P, per_peer), displs(P);
    counts[world.rank()] = 0;
    for (int q = 0; q < P; ++q) displs[q] = q * per_peer;
    std::vector<char> send(static_cast<std::size_t>(per_peer * P), 1), recv(send.size());
    const double t = time_collective(
        world, thread,
        [&] { world.alltoallv(recv.data(), counts, displs, send.data(), counts, displs); }, 30);
    const double bytes = static_cast<double>(per_peer * (P - 1));
    f.alltoall_bandwidth = bytes / std::max(t - (P - 1) * f.latency, 0.1 * t);
    // The same with the peers 2 ms late: a rank that waits has gone to polling with sleeps
    // (core/comm.h), and the exchange finishes only at its next poll.
    const double late = time_collective(
        world, thread,
        [&] { world.alltoallv(recv.data(), counts, displs, send.data(), counts, displs); }, 10,
        2e-3);
    f.late_penalty = std::max(0.0, late - t);
    if (static_cast<unsigned>(P) > std::max(1u, std::thread::hardware_concurrency()))
      measure_shares(
          world, thread,
          [&] { world.alltoallv(recv.data(), counts, displs, send.data(), counts, displs); }, t,
          f);
    // An even exchange against one in which rank 0 receives twice its share (every other rank
    // sends it 2·pp): rank 0 then receives 2(P − 1)·pp, the most any rank moves, while all ranks
    // together move (P + 1)/P times the even exchange's bytes. Per-rank links take 2× the even
    // time, one shared link (P + 1)/P×; where the ratio falls between says which binds. At
    // least 4 MiB a rank, so that bytes rather than latency and polling set both times; three
    // alternating rounds, the median ratio (the machine may drift between them).
    const int64_t pp = std::max<int64_t>(per_peer, (4 << 20) / (P - 1));
    std::vector<int64_t> even(P, pp), skew_send(P, pp), skew_recv(P, pp), displs2(P);
    even[world.rank()] = skew_send[world.rank()] = skew_recv[world.rank()] = 0;
    if (world.rank() != 0) skew_send[0] = 2 * pp;
    if (world.rank() == 0)
      for (int q = 1; q < P; ++q) skew_recv[q] = 2 * pp;
    for (int q = 0; q < P; ++q) displs2[q] = q * 2 * pp;
    std::vector<char> big_in(static_cast<std::size_t>(2 * pp * P), 1), big_out(big_in.size());
    std::vector<double> ratios;
    for (int round = 0; round < 3; ++round) {
      const double te = time_collective(
          world, thread,
          [&] {
            world.alltoallv(big_out.data(), even, displs2, big_in.data(), even, displs2);
          },
          5);
      const double ts = time_collective(
          world, thread,
          [&] {
            world.alltoallv(big_out.data(), skew_recv, displs2, big_in.data(), skew_send,
                            displs2);
          },
          5);
      ratios.push_back(ts / te);
    }
    std::sort(ratios.begin(), ratios.end());
    const double shared = static_cast<double>(P + 1) / P;
    f.receiver_bound = std::clamp((ratios[1] - shared) / (2.0 - shared), 0.0, 1.0);
  }
  // All-reduce as the gradient reduction runs it (parallel/grad_sync.h): a bucket (at most
  // 25 MiB, the trainer's bucket size) packed from the gradient buffer, reduce-scattered,
  // all-gathered and unpacked back.
  {
    const int64_t n = std::max<int64_t>(P, std::min<int64_t>(grad_bytes, 25 << 20) / 4);
    std::vector<int64_t> counts(P);
    for (int q = 0; q < P; ++q) counts[q] = chunk_begin(n, q + 1, P) - chunk_begin(n, q, P);
    std::vector<float> flat(static_cast<std::size_t>(n), 1.0f), in(flat.size()),
        out(counts[world.rank()]), all(flat.size());
    const double t = time_collective(
        world, thread,
        [&] {
          std::memcpy(in.data(), flat.data(), flat.size() * sizeof(float));
          world.reduce_scatter(out.data(), in.data(), counts);
          world.allgather(all.data(), out.data(), counts);
          std::memcpy(flat.data(), all.data(), flat.size() * sizeof(float));
        },
        9);
    const double ring = 2.0 * (P - 1) / P * 4.0 * static_cast<double>(n);
    f.allreduce_bandwidth = ring / std::max(t - 2.0 * (P - 1) * f.latency, 0.1 * t);
    // The same bucket over a group of one, as each rank reduces the experts only it holds.
    std::unique_ptr<Comm> one = world.split(world.rank(), 0, {"group_of_one"});
    const std::vector<int64_t> whole = {n};
    const double t1 = time_collective(
        world, thread,
        [&] {
          std::memcpy(in.data(), flat.data(), flat.size() * sizeof(float));
          one->reduce_scatter(all.data(), in.data(), whole);
          one->allgather(in.data(), all.data(), whole);
          std::memcpy(flat.data(), in.data(), flat.size() * sizeof(float));
        },
        9);
    f.self_reduce_bandwidth = 4.0 * static_cast<double>(n) / t1;
  }
  return f;
}

void write_comm_figures(const CommFigures& f, const std::string& path) {
  std::string s = fmt::format("{} {:.9e} {:.9e} {:.9e} {:.9e} {:.9e} {:.9e} {}", f.procs, f.latency,
                              f.alltoall_bandwidth, f.allreduce_bandwidth, f.late_penalty,
                              f.receiver_bound, f.self_reduce_bandwidth, f.share.size());
  for (std::size_t i = 0; i < f.share.size(); ++i)
    s += fmt::format(" {:.9e} {:.9e}", f.share_ratio[i], f.share[i]);
  write_file_atomic(path, s + "\n");
}

CommFigures read_comm_figures(const std::string& path) {
  std::ifstream in(path);
  CommFigures f;
  in >> f.procs >> f.latency >> f.alltoall_bandwidth >> f.allreduce_bandwidth >> f.late_penalty >>
      f.receiver_bound >> f.self_reduce_bandwidth;
  std::size_t shares = 0;
  in >> shares;
  MOETRAIN_CHECK(in && shares < 64, "{}: not what plan --calibrate-comm writes", path);
  f.share_ratio.resize(shares);
  f.share.resize(shares);
  for (std::size_t i = 0; i < shares; ++i) in >> f.share_ratio[i] >> f.share[i];
  MOETRAIN_CHECK(in && f.procs > 0 && f.latency > 0 && f.alltoall_bandwidth > 0 &&
                     f.allreduce_bandwidth > 0,
                 "{}: not what plan --calibrate-comm writes", path);
  return f;
}

CommFigures calibrate_comm(int64_t procs, int64_t grad_bytes, int64_t a2a_bytes,
                           const std::vector<std::string>& mpirun_args) {
#if !MOETRAIN_WITH_MPI
  MOETRAIN_FAIL("plan --calibrate --comm-procs {}: this build has no MPI (MOETRAIN_WITH_MPI=OFF); "
                "pass --comm-procs 0 to skip measuring the collectives",
                procs);
#endif
  MOETRAIN_CHECK(procs >= 2, "--comm-procs {}: each count must be ≥ 2", procs);
  char self[4096];
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  MOETRAIN_CHECK(len > 0, "plan --calibrate: cannot find this program (/proc/self/exe)");
  self[len] = '\0';
  const std::string out =
      (std::filesystem::temp_directory_path() / fmt::format("moetrain_comm_{}_{}.txt", ::getpid(),
                                                            procs))
          .string();
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  // One thread per process: the collectives run on the communication thread beside it.
  std::string extra;
  for (const std::string& a : mpirun_args) {
    // One shell word each, as given: single quotes, with each ' closed, escaped and reopened.
    std::string word = "'";
    for (char c : a) word += c == '\'' ? std::string("'\\''") : std::string(1, c);
    extra += " " + word + "'";
  }
  const std::string cmd = fmt::format(
      "OMP_NUM_THREADS=1 mpirun -n {} {}{} '{}' plan --calibrate-comm --grad-bytes {} "
      "--a2a-bytes {} --out '{}' > '{}.log' 2>&1",
      procs, static_cast<unsigned>(procs) > cores ? "--oversubscribe" : "", extra, self,
      grad_bytes, a2a_bytes, out, out);
  const int rc = std::system(cmd.c_str());
  std::string log;
  {
    std::ifstream in(out + ".log");
    log.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::filesystem::remove(out + ".log");
  if (rc != 0) {
    const std::string refusal = mpirun_refusal(log);
    MOETRAIN_CHECK(refusal.empty(),
                   "plan --calibrate: measuring the collectives with {} processes: {}; "
                   "--comm-procs 0 skips them",
                   procs, refusal);
    MOETRAIN_FAIL(
        "plan --calibrate: measuring the collectives with {} processes failed ({}); "
        "--comm-procs 0 skips them. mpirun said: {}",
        procs, cmd, log);
  }
  const CommFigures f = read_comm_figures(out);
  std::filesystem::remove(out);
  return f;
}

}  // namespace moetrain::plan
