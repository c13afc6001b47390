// The expert all-to-all on known patterns: every row arrives at its expert's owner, by source rank
// and within a source by local expert, and comes back to where it left; pairs with nothing to send
// and ranks that receive nothing; the 2-D route, and the adaptive route's mixes of direct and
// relayed node pairs, give the same bits as the flat one.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/check.h"
#include "parallel/alltoall.h"
#include "parallel/runtime.h"

using namespace moetrain;

namespace {

constexpr int64_t kC = 3;

// Rows rank s routes to global expert e: a pattern with zeros, including whole ranks left idle.
int64_t rows_for(int s, int64_t e, int pattern) {
  switch (pattern) {
    case 0:
      return (s * 7 + e * 3) % 5;  // mixed, some zeros
    case 1:
      return e < 2 ? 3 + s : 0;  // everything to the experts of rank 0
    case 2:
      return 0;  // nothing at all
    default:
      return s == 0 ? (e % 2) * 4 : 0;  // one sender
  }
}

// The value of element c of the i-th row that rank s sends to expert e.
float value(int s, int64_t e, int64_t i, int64_t c) {
  return static_cast<float>(s * 10000 + e * 100 + i * kC + c);
}

struct Result {
  std::vector<float> received, returned;
  std::vector<int64_t> expert_counts;
};

Result run(Comm& group, const A2aRoute& route, int64_t El, int pattern) {
  const int P = group.size(), r = group.rank();
  const int64_t E = El * P;
  std::vector<int64_t> counts(E);
  std::vector<float> send;
  for (int64_t e = 0; e < E; ++e) {
    counts[e] = rows_for(r, e, pattern);
    for (int64_t i = 0; i < counts[e]; ++i)
      for (int64_t c = 0; c < kC; ++c) send.push_back(value(r, e, i, c));
  }
  A2aLayout plan;
  a2a_plan(plan, route, counts.data(), E, kC);
  A2aScratch scratch;
  Result out;
  out.received.assign(plan.R_recv * kC + 1, -1.0f);
  out.returned.assign(plan.R_send * kC + 1, -1.0f);
  a2a_dispatch(out.received.data(), send.data(), plan, route, scratch);
  // Source-major: source s ascending, then local expert j, rows in the order sent.
  std::size_t at = 0;
  int64_t bad = 0;
  std::vector<int64_t> per_expert(El, 0);
  for (int s = 0; s < P; ++s) {
    EXPECT_EQ(plan.recv_offset[s] * kC, static_cast<int64_t>(at));
    for (int64_t j = 0; j < El; ++j) {
      const int64_t e = r * El + j;
      EXPECT_EQ(plan.recv_counts[s * El + j], rows_for(s, e, pattern));
      per_expert[j] += rows_for(s, e, pattern);
      for (int64_t i = 0; i < rows_for(s, e, pattern); ++i)
        for (int64_t c = 0; c < kC; ++c) bad += out.received[at++] != value(s, e, i, c);
    }
  }
  EXPECT_EQ(plan.expert_counts, per_expert);
  EXPECT_EQ(bad, 0) << "misplaced rows on rank " << r;
  EXPECT_EQ(out.received.back(), -1.0f);
  a2a_combine(out.returned.data(), out.received.data(), plan, route, scratch);
  EXPECT_EQ(0, std::memcmp(out.returned.data(), send.data(), send.size() * sizeof(float)))
      << "rank " << r;
  EXPECT_EQ(out.returned.back(), -1.0f);
  out.expert_counts = plan.expert_counts;
  return out;
}

}  // namespace

TEST(AllToAll, FlatKnownPatterns) {
  auto group = dist_world("a2a");
  for (int pattern = 0; pattern < 4; ++pattern)
    for (int64_t El : {1, 2, 3}) run(*group, A2aRoute{group.get()}, El, pattern);
}

TEST(AllToAll, TwoDimensionalEqualsFlatBitwise) {
  auto group = dist_world("a2a2d");
  const int P = group->size();
  for (int per_node = 0; per_node <= P; ++per_node) {
    if (per_node > 0 && P % per_node != 0) continue;
    A2aHierarchy h = make_a2a_hierarchy(*group, per_node);  // 0: the ranks sharing memory
    EXPECT_EQ(h.intra->size() * h.inter->size(), P);
    for (int pattern = 0; pattern < 4; ++pattern) {
      for (int64_t El : {1, 2}) {
        Result flat = run(*group, A2aRoute{group.get()}, El, pattern);
        Result two_d = run(*group, h.route(*group), El, pattern);
        EXPECT_EQ(flat.received.size(), two_d.received.size());
        EXPECT_EQ(
            0, std::memcmp(flat.received.data(), two_d.received.data(),
                           std::min(flat.received.size(), two_d.received.size()) * sizeof(float)))
            << "per node " << per_node << " pattern " << pattern;
      }
    }
  }
}

// Every relay matrix of the adaptive route moves the same bytes to the same places: all of them
// for two nodes, a spread of them for more. run() checks each row's place and the round trip.
TEST(AllToAll, MixedRoutesEqualFlatBitwise) {
  auto group = dist_world("a2a_mixed");
  const int P = group->size();
  for (int per_node = 1; per_node < P; ++per_node) {
    if (P % per_node != 0) continue;
    A2aHierarchy h = make_a2a_hierarchy(*group, per_node);
    const int nodes = P / per_node, pairs = nodes * (nodes - 1);
    std::vector<uint64_t> masks;
    if (pairs <= 6) {
      for (uint64_t m = 0; m < (uint64_t{1} << pairs); ++m) masks.push_back(m);
    } else {
      uint64_t x = 12345;
      for (int i = 0; i < 12; ++i) masks.push_back((x = x * 6364136223846793005ULL + 1) >> 20);
    }
    for (const uint64_t mask : masks) {
      std::vector<uint8_t> relay(static_cast<std::size_t>(nodes) * nodes, 0);
      for (int a = 0, bit = 0; a < nodes; ++a)
        for (int b = 0; b < nodes; ++b)
          if (a != b) relay[a * nodes + b] = (mask >> bit++) & 1;
      A2aRoute route = h.route(*group);
      route.relay = &relay;
      for (int pattern = 0; pattern < 4; ++pattern) {
        for (int64_t El : {1, 2}) {
          Result flat = run(*group, A2aRoute{group.get()}, El, pattern);
          Result mixed = run(*group, route, El, pattern);
          ASSERT_EQ(flat.received.size(), mixed.received.size());
          EXPECT_EQ(0, std::memcmp(flat.received.data(), mixed.received.data(),
                                   flat.received.size() * sizeof(float)))
              << "per node " << per_node << " mask " << mask << " pattern " << pattern;
        }
      }
    }
  }
}

TEST(AllToAll, UnevenNodesAreRefused) {
  auto group = dist_world("a2a_bad");
  if (group->size() < 3)
    GTEST_SKIP() << "needs a group that a ranks-per-node value does not divide";
  EXPECT_THROW(make_a2a_hierarchy(*group, group->size() - 1), Error);
}
