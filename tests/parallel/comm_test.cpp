// Collectives with closed-form answers, on the MPI backend (under mpiexec) and the local one.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "parallel/groups.h"
#include "parallel/runtime.h"

using namespace moetrain;

namespace {

std::unique_ptr<Comm> world() {
  return dist_world("test");
}

// The bits of v on every rank, so a test can check that all ranks hold the same result.
template <class T>
bool same_on_every_rank(Comm& comm, const std::vector<T>& v) {
  const int64_t bytes = static_cast<int64_t>(v.size() * sizeof(T));
  std::vector<char> all(static_cast<std::size_t>(bytes * comm.size()));
  std::vector<int64_t> counts(comm.size(), bytes), displs(comm.size());
  for (int q = 0; q < comm.size(); ++q) displs[q] = q * bytes;
  comm.allgatherv(all.data(), counts, displs, v.data());
  for (int q = 1; q < comm.size(); ++q)
    if (std::memcmp(all.data(), all.data() + q * bytes, static_cast<std::size_t>(bytes)) != 0)
      return false;
  return true;
}

// A value that rounds differently depending on the order of the additions.
float awkward(int rank, int64_t i) {
  static const float kValues[] = {1e8f, 3.0f, -1e8f, 1.0f, 0.1f, -7.5e7f, 2.5e-3f};
  return kValues[(rank * 3 + i) % 7] * (1.0f + 0.01f * static_cast<float>(i));
}

}  // namespace

TEST(Comm, MpiIsRunningWithSeveralRanks) {
  ASSERT_TRUE(dist_mpi_active());
  auto w = world();
  EXPECT_EQ(std::string(w->backend()), "mpi");
  EXPECT_GE(w->size(), 2);
  EXPECT_GE(dist_local_size(), 1);
}

TEST(Comm, AllreduceOfRankIsClosedForm) {
  auto w = world();
  const int P = w->size(), r = w->rank();
  for (int64_t n : {1, 2, 7, 64}) {
    std::vector<int64_t> i64(n);
    std::vector<float> f32(n);
    std::vector<double> f64(n);
    for (int64_t i = 0; i < n; ++i) {
      i64[i] = r + i;
      f32[i] = static_cast<float>(r + i);
      f64[i] = r + 0.5 * i;
    }
    w->allreduce(i64.data(), n);
    w->allreduce(f32.data(), n);
    w->allreduce(f64.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(i64[i], P * (P - 1) / 2 + P * i) << "n " << n << " i " << i;
      EXPECT_EQ(f32[i], static_cast<float>(P * (P - 1) / 2 + P * i));
      EXPECT_EQ(f64[i], P * (P - 1) / 2.0 + P * 0.5 * i);
    }
  }
  std::vector<int64_t> none;
  w->allreduce(none.data(), 0);  // no elements: still collective, nothing to do
  std::vector<int64_t> mx = {r, -r};
  w->allreduce(mx.data(), 2, {ReduceOp::Max});
  EXPECT_EQ(mx[0], P - 1);
  EXPECT_EQ(mx[1], 0);
}

TEST(Comm, FloatSumsRunInRankOrderAndAgreeBitwise) {
  auto w = world();
  const int P = w->size();
  for (int64_t n : {1, 3, 13}) {
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = awkward(w->rank(), i);
    w->allreduce(v.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      float expect = awkward(0, i);
      for (int q = 1; q < P; ++q) expect += awkward(q, i);
      EXPECT_EQ(v[i], expect) << "element " << i << " of " << n;
    }
    EXPECT_TRUE(same_on_every_rank(*w, v));
  }
}

TEST(Comm, ReduceScatterWithZeroCounts) {
  auto w = world();
  const int P = w->size(), r = w->rank();
  // Rank q's chunk has q elements: rank 0 receives nothing.
  std::vector<int64_t> counts(P);
  std::iota(counts.begin(), counts.end(), 0);
  const int64_t total = P * (P - 1) / 2;
  std::vector<double> in(total);
  for (int64_t i = 0; i < total; ++i) in[i] = 1000.0 * r + static_cast<double>(i);
  std::vector<double> out(counts[r] + 1, -1.0);
  w->reduce_scatter(out.data(), in.data(), counts);
  const int64_t first = r * (r - 1) / 2;
  for (int64_t i = 0; i < counts[r]; ++i)
    EXPECT_EQ(out[i], 1000.0 * P * (P - 1) / 2 + static_cast<double>(P * (first + i)));
  EXPECT_EQ(out[counts[r]], -1.0) << "wrote past its chunk";
}

TEST(Comm, AllgatherVariableCounts) {
  auto w = world();
  const int P = w->size(), r = w->rank();
  std::vector<int64_t> counts(P);
  for (int q = 0; q < P; ++q) counts[q] = q % 2 == 0 ? 0 : q + 1;
  std::vector<int32_t> mine(counts[r]);
  for (int64_t i = 0; i < counts[r]; ++i) mine[i] = r * 100 + static_cast<int32_t>(i);
  std::vector<int32_t> all(std::accumulate(counts.begin(), counts.end(), int64_t{0}));
  w->allgather(all.data(), mine.data(), counts);
  std::size_t at = 0;
  for (int q = 0; q < P; ++q)
    for (int64_t i = 0; i < counts[q]; ++i) EXPECT_EQ(all[at++], q * 100 + i);
  auto ones = w->allgather_one(7 * r);
  for (int q = 0; q < P; ++q) EXPECT_EQ(ones[q], 7 * q);
}

TEST(Comm, AllgatherSameOrdersRanks) {
  auto w = world();
  const int P = w->size(), r = w->rank();
  const double mine[2] = {r + 0.5, -r - 0.25};
  const std::vector<double> all = w->allgather_same(mine);
  ASSERT_EQ(all.size(), static_cast<std::size_t>(2 * P));
  for (int q = 0; q < P; ++q) {
    EXPECT_EQ(all[2 * q], q + 0.5);
    EXPECT_EQ(all[2 * q + 1], -q - 0.25);
  }
  auto local = make_local_comm();
  EXPECT_EQ(local->allgather_same(mine), std::vector<double>(mine, mine + 2));
}

TEST(Comm, AlltoallvKnownPatternWithZeroCounts) {
  auto w = world();
  const int P = w->size(), r = w->rank();
  // Rank s sends (s + q) % 3 floats to rank q (so some pairs send nothing), valued s·1000 + q·10 +
  // i.
  auto count = [](int s, int q) { return static_cast<int64_t>((s + q) % 3); };
  std::vector<int64_t> sc(P), sd(P), rc(P), rd(P);
  int64_t sn = 0, rn = 0;
  for (int q = 0; q < P; ++q) {
    sc[q] = count(r, q) * 4, sd[q] = sn * 4, sn += count(r, q);
    rc[q] = count(q, r) * 4, rd[q] = rn * 4, rn += count(q, r);
  }
  std::vector<float> send(sn), recv(rn, -1.0f);
  for (int q = 0, at = 0; q < P; ++q)
    for (int64_t i = 0; i < count(r, q); ++i)
      send[at++] = static_cast<float>(r * 1000 + q * 10 + i);
  w->alltoallv(recv.data(), rc, rd, send.data(), sc, sd);
  for (int q = 0, at = 0; q < P; ++q)
    for (int64_t i = 0; i < count(q, r); ++i)
      EXPECT_EQ(recv[at++], static_cast<float>(q * 1000 + r * 10 + i)) << "from " << q;
}

TEST(Comm, AlltoallvEverythingToOneRankAndOddBytes) {
  auto w = world();
  const int P = w->size(), r = w->rank();
  // Every rank sends r + 1 bytes to rank 0 only: odd sizes, and every other pair sends nothing.
  std::vector<int64_t> sc(P, 0), sd(P, 0), rc(P, 0), rd(P, 0);
  sc[0] = r + 1;
  int64_t rn = 0;
  if (r == 0)
    for (int q = 0; q < P; ++q) rc[q] = q + 1, rd[q] = rn, rn += q + 1;
  std::vector<char> send(r + 1, static_cast<char>('a' + r)), recv(rn + 1, '?');
  w->alltoallv(recv.data(), rc, rd, send.data(), sc, sd);
  if (r == 0) {
    std::size_t at = 0;
    for (int q = 0; q < P; ++q)
      for (int i = 0; i <= q; ++i) EXPECT_EQ(recv[at++], 'a' + q);
  }
  EXPECT_EQ(recv.back(), '?');
}

TEST(Comm, AlltoallvBlocksGathersAndScatters) {
  auto w = world();
  const int P = w->size(), r = w->rank();
  // To rank q: bytes "rq" then "s", taken from two places of the send buffer; received into two
  // separate places per source, split at a different point than it was sent.
  std::vector<char> send(8 * P, '.');
  std::vector<std::vector<ByteBlock>> sb(P), rb(P);
  for (int q = 0; q < P; ++q) {
    send[8 * q] = static_cast<char>('a' + r), send[8 * q + 1] = static_cast<char>('A' + q);
    send[8 * q + 5] = '!';
    sb[q] = {{8 * q, 2}, {8 * q + 5, 1}};
    rb[q] = {{10 * q + 7, 1}, {10 * q, 2}};
  }
  std::vector<char> recv(10 * P, '.');
  w->alltoallv_blocks(recv.data(), rb, send.data(), sb);
  for (int q = 0; q < P; ++q) {
    EXPECT_EQ(recv[10 * q + 7], 'a' + q);
    EXPECT_EQ(recv[10 * q], 'A' + r);
    EXPECT_EQ(recv[10 * q + 1], '!');
    EXPECT_EQ(recv[10 * q + 2], '.');
  }
  // One block per peer, zero-length blocks nowhere.
  std::vector<std::vector<ByteBlock>> one(P), back(P);
  std::vector<int32_t> mine(P), got(P, -1);
  for (int q = 0; q < P; ++q) {
    mine[q] = r * 100 + q;
    one[q] = {{4 * q, 4}};
    back[q] = {{4 * q, 4}};
  }
  w->alltoallv_blocks(got.data(), back, mine.data(), one);
  for (int q = 0; q < P; ++q) EXPECT_EQ(got[q], q * 100 + r);
}

TEST(Comm, BroadcastFromTheLastRank) {
  auto w = world();
  std::vector<double> v(5, static_cast<double>(w->rank()));
  w->broadcast(v.data(), static_cast<int64_t>(v.size() * sizeof(double)), {w->size() - 1});
  for (double x : v) EXPECT_EQ(x, w->size() - 1);
}

TEST(Comm, ProcessGroupsSplitDpTimesEp) {
  auto w = world();
  const int P = w->size(), r = w->rank();
  for (int ep = 1; ep <= P; ++ep) {
    if (P % ep != 0) {
      EXPECT_THROW(make_parallel_layout(P, r, ep), Error);
      continue;
    }
    ProcessGroups g = make_process_groups(*w, ep);
    EXPECT_EQ(g.layout.ep, ep);
    EXPECT_EQ(g.layout.dp, P / ep);
    EXPECT_EQ(g.a2a->size(), ep);
    EXPECT_EQ(g.a2a->rank(), r % ep);
    EXPECT_EQ(g.expert_grads->size(), P / ep);
    EXPECT_EQ(g.expert_grads->rank(), r / ep);
    EXPECT_EQ(g.control->size(), P);
    // Members of my EP group are dp·ep .. dp·ep + ep − 1; of my EDP group ep_index + k·ep.
    int64_t a = r, b = r;
    g.a2a->allreduce(&a, 1);
    g.expert_grads->allreduce(&b, 1);
    const int64_t d = r / ep, e = r % ep, dp = P / ep;
    EXPECT_EQ(a, d * ep * ep + ep * (ep - 1) / 2);
    EXPECT_EQ(b, e * dp + ep * dp * (dp - 1) / 2);
  }
  EXPECT_THROW(expert_shard(6, 4, 0), Error);
  EXPECT_EQ(expert_shard(8, 4, 3).first, 6);
  EXPECT_EQ(expert_shard(8, 4, 3).count, 2);
}

TEST(Comm, BadCountsAreRefused) {
  auto w = world();
  std::vector<int64_t> wrong(w->size() + 1, 0);
  float x = 0;
  EXPECT_THROW(w->reduce_scatter(&x, &x, wrong), Error);
  std::vector<int64_t> negative(w->size(), 0);
  negative[0] = -1;
  EXPECT_THROW(w->allgatherv(&x, negative, negative, &x), Error);
}

TEST(Comm, LocalBackendCopies) {
  auto c = make_local_comm("local_test");
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->rank(), 0);
  std::vector<float> v = {1.5f, -2.0f, 3.25f};
  c->allreduce(v.data(), 3);
  EXPECT_EQ(v, (std::vector<float>{1.5f, -2.0f, 3.25f}));
  std::vector<float> out(3);
  std::vector<int64_t> counts = {3};
  c->reduce_scatter(out.data(), v.data(), counts);
  EXPECT_EQ(out, v);
  std::vector<int64_t> bytes = {12}, zero = {0};
  std::vector<float> recv(3);
  c->alltoallv(recv.data(), bytes, zero, v.data(), bytes, zero);
  EXPECT_EQ(recv, v);
  auto sub = c->split(0, 0, {"sub"});
  EXPECT_EQ(sub->size(), 1);
  EXPECT_EQ(sub->name(), "sub");
  ProcessGroups g = make_process_groups(*c, 1);
  EXPECT_EQ(g.a2a->size(), 1);
  EXPECT_THROW(make_process_groups(*c, 2), Error);
}

// Point to point around a ring: every rank sends its neighbours two tagged messages posted in the
// order opposite to the one the receiver asks for them in; each arrives whole at the right place.
TEST(Comm, PointToPointMatchesPeerAndTag) {
  auto w = world();
  const int P = w->size(), r = w->rank();
  const int next = (r + 1) % P, prev = (r + P - 1) % P;
  auto payload = [](int from, int tag, int64_t n) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(from * 1000 + tag * 100) + 0.5f * i;
    return v;
  };
  // 100003 floats: past the eager limit, so the sends need the receiver (rendezvous).
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
    const std::vector<float> a = payload(r, 1, n), b = payload(r, 2, n + 1);
    std::vector<std::unique_ptr<Transfer>> sent;
    sent.push_back(w->isend(a.data(), n * 4, next, {.tag = 1}));
    sent.push_back(w->isend(b.data(), (n + 1) * 4, next, {.tag = 2}));
    std::vector<float> got2(static_cast<std::size_t>(n + 1)), got1(static_cast<std::size_t>(n));
    w->recv(got2.data(), (n + 1) * 4, prev, {.tag = 2});
    auto pending = w->irecv(got1.data(), n * 4, prev, {.tag = 1});
    pending->wait();
    for (auto& t : sent) t->wait();
    EXPECT_EQ(got1, payload(prev, 1, n)) << "n " << n;
    EXPECT_EQ(got2, payload(prev, 2, n + 1)) << "n " << n;
  }
  // Blocking both ways between two ranks that exchange in a fixed order.
  if (P >= 2 && r < 2) {
    int64_t v = 40 + r, got = -1;
    if (r == 0) {
      w->send(&v, 8, 1, {.tag = 7});
      w->recv(&got, 8, 1, {.tag = 7});
    } else {
      w->recv(&got, 8, 0, {.tag = 7});
      w->send(&v, 8, 0, {.tag = 7});
    }
    EXPECT_EQ(got, 40 + (1 - r));
  }
  w->barrier();
}

TEST(Comm, PointToPointRefusesBadArguments) {
  auto w = world();
  int64_t v = 0;
  EXPECT_THROW(w->isend(&v, 8, w->size(), {}), Error);
  EXPECT_THROW(w->irecv(&v, 8, -1, {}), Error);
  EXPECT_THROW(w->isend(&v, 8, 0, {.tag = 40000}), Error);
  EXPECT_THROW(w->irecv(nullptr, 8, 0, {}), Error);
}

TEST(Comm, LocalBackendSendsToItself) {
  auto c = make_local_comm("self");
  const std::vector<int32_t> a = {1, 2, 3}, b = {9};
  c->send(a.data(), 12, 0, {.tag = 3});
  c->send(b.data(), 4, 0, {.tag = 4});
  c->send(b.data(), 4, 0, {.tag = 3});
  std::vector<int32_t> got(3), one(1);
  c->recv(one.data(), 4, 0, {.tag = 4});
  EXPECT_EQ(one, b);
  c->recv(got.data(), 12, 0, {.tag = 3});  // the first message of tag 3
  EXPECT_EQ(got, a);
  EXPECT_THROW(c->recv(got.data(), 12, 0, {.tag = 3}), Error);  // 4 bytes were sent
  c->recv(one.data(), 4, 0, {.tag = 3});
  EXPECT_THROW(c->recv(one.data(), 4, 0, {.tag = 3}), Error);  // nothing left: would wait forever
  EXPECT_THROW(c->send(a.data(), 12, 1, {}), Error);
}
