// The collective registry, the watchdog and --debug-collectives on real MPI communicators: a rank
// that skips a collective, or passes other sizes or another element type, fails at once on every
// rank with both sides named; a rank that arrives late trips the watchdog on the others.
#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "parallel/runtime.h"
#include "parallel/watchdog.h"
#include "support/expect_error.h"

using namespace moetrain;
using moetrain::testing::error_of;

namespace {

// Turns the fingerprint exchange on for one test and off again.
class DebugCollectives {
 public:
  DebugCollectives() { set_debug_collectives(true); }
  ~DebugCollectives() { set_debug_collectives(false); }
};

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST(DebugCollectivesTest, MatchingCallsGiveTheUsualResults) {
  auto comm = dist_world("fp_ok");
  DebugCollectives on;
  int64_t v = comm->rank();
  comm->allreduce(&v, 1);
  EXPECT_EQ(v, comm->size() * (comm->size() - 1) / 2);
  std::vector<float> f(5, 1.0f);
  comm->allreduce(f.data(), 5);
  for (float x : f) EXPECT_EQ(x, static_cast<float>(comm->size()));
  int64_t b = comm->rank() == 0 ? 42 : 0;
  comm->broadcast(&b, sizeof(b));
  EXPECT_EQ(b, 42);
  comm->barrier();
}

TEST(DebugCollectivesTest, ARankSkippingAnAlltoallFailsEveryRankNamingBothSides) {
  auto comm = dist_world("fp_skip");
  const int P = comm->size(), last = P - 1;
  DebugCollectives on;
  std::vector<int64_t> counts(P, 8), displs(P);
  for (int q = 0; q < P; ++q) displs[q] = 8 * q;
  std::vector<char> send(8 * P, 'x'), recv(8 * P);
  // The last rank skips the all-to-all and goes on to the next collective, a barrier.
  const std::string msg = error_of([&] {
    if (comm->rank() != last)
      comm->alltoallv(recv.data(), counts, displs, send.data(), counts, displs);
    else
      comm->barrier();
  });
  ASSERT_FALSE(msg.empty()) << "rank " << comm->rank() << " did not fail";
  EXPECT_TRUE(has(msg, "collective mismatch on communicator 'fp_skip'")) << msg;
  EXPECT_TRUE(has(msg, "alltoallv #1")) << msg;
  EXPECT_TRUE(has(msg, "barrier #1")) << msg;
  EXPECT_TRUE(has(msg, "rank " + std::to_string(last))) << msg;
  // Both sides consumed one fingerprint exchange: the communicator is still in step.
  int64_t v = 1;
  comm->allreduce(&v, 1);
  EXPECT_EQ(v, P);
}

TEST(DebugCollectivesTest, ElementTypeAndBroadcastRootMismatchesAreNamed) {
  auto comm = dist_world("fp_type");
  DebugCollectives on;
  // 8 bytes everywhere, but rank 0 reduces two floats while the others reduce one double.
  const std::string type = error_of([&] {
    if (comm->rank() == 0) {
      float f[2] = {1, 2};
      comm->allreduce(f, 2);
    } else {
      double d = 1;
      comm->allreduce(&d, 1);
    }
  });
  EXPECT_TRUE(has(type, "4-byte elements")) << type;
  EXPECT_TRUE(has(type, "8-byte elements")) << type;
  EXPECT_TRUE(has(type, "allreduce")) << type;
  const std::string root = error_of([&] {
    int64_t x = 0;
    BroadcastOptions o;
    o.root = comm->rank() == 0 ? 1 : 0;
    comm->broadcast(&x, sizeof(x), o);
  });
  EXPECT_TRUE(has(root, "broadcast")) << root;
  EXPECT_TRUE(has(root, "different sizes")) << root;
}

TEST(DebugCollectivesTest, AlltoallCountsThatDoNotPairUpFailEveryRank) {
  auto comm = dist_world("fp_counts");
  const int P = comm->size();
  DebugCollectives on;
  // Rank 1 sends 16 bytes to rank 0, which expects 8 from everyone.
  std::vector<int64_t> send_counts(P, 8), recv_counts(P, 8), sd(P), rd(P);
  if (comm->rank() == 1) send_counts[0] = 16;
  for (int q = 0; q < P; ++q) sd[q] = 16 * q, rd[q] = 16 * q;
  std::vector<char> send(16 * P, 'y'), recv(16 * P);
  const std::string msg = error_of(
      [&] { comm->alltoallv(recv.data(), recv_counts, rd, send.data(), send_counts, sd); });
  EXPECT_TRUE(has(msg, "rank 1 sends 16 bytes to rank 0, which expects 8")) << msg;
}

TEST(WatchdogTest, ALateRankTripsTheWatchdogOnItsPeersNamingTheCollective) {
  auto comm = dist_world("wd");
  std::mutex mutex;
  std::vector<std::string> timeouts;
  {
    CollectiveWatchdog dog({0.1, 0.4}, [&](const std::string& m) {
      std::lock_guard<std::mutex> lock(mutex);
      timeouts.push_back(m);
    });
    comm->barrier();  // #1: everyone present
    if (comm->rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    comm->barrier();  // #2: the others wait for rank 0
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (comm->rank() == 0) {
    EXPECT_TRUE(timeouts.empty()) << timeouts.front();
  } else {
    ASSERT_EQ(timeouts.size(), 1u);  // reported once
    const std::string& m = timeouts[0];
    EXPECT_TRUE(has(m, "barrier #2 on communicator 'wd'")) << m;
    EXPECT_TRUE(has(m, "rank " + std::to_string(comm->rank()))) << m;
    EXPECT_TRUE(has(m, "dist.collective_timeout")) << m;
  }
  EXPECT_TRUE(active_collectives().empty());
}

// A pipeline stage waits for its neighbour's activations point to point: a wait for a peer that
// does not send trips the watchdog too, naming the peer and the tag, and the transfer then ends
// normally when the message arrives.
TEST(WatchdogTest, AReceiveFromALateRankTripsTheWatchdogNamingThePeer) {
  auto comm = dist_world("wd_p2p");
  if (comm->size() < 2) GTEST_SKIP() << "needs two ranks";
  std::mutex mutex;
  std::vector<std::string> timeouts;
  std::vector<ActiveCollective> seen;
  const int me = comm->rank();
  {
    CollectiveWatchdog dog({0, 0.3}, [&](const std::string& m) {
      std::lock_guard<std::mutex> lock(mutex);
      timeouts.push_back(m);
      seen = active_collectives();
    });
    std::vector<float> buf(256, static_cast<float>(me));
    if (me == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1200));
      comm->send(buf.data(), 1024, 1, {.tag = 7});
    } else if (me == 1) {
      comm->recv(buf.data(), 1024, 0, {.tag = 7});
      EXPECT_EQ(buf[255], 0.0f);  // rank 0's values arrived
    }
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (me == 1) {
    ASSERT_EQ(timeouts.size(), 1u);  // reported once
    const std::string& m = timeouts[0];
    EXPECT_TRUE(has(m, "recv from rank 0 (tag 7) on communicator 'wd_p2p' (rank 1), 1024 bytes"))
        << m;
    EXPECT_TRUE(has(m, "dist.collective_timeout")) << m;
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_EQ(seen[0].kind, CollectiveKind::Recv);
    EXPECT_EQ(seen[0].peer, 0);
  } else if (me == 0) {
    // The send is buffered or waits for a receive already posted: no timeout on the sender.
    EXPECT_TRUE(timeouts.empty()) << timeouts.front();
  }
  EXPECT_TRUE(active_collectives().empty());
}

TEST(WatchdogTest, TheRegistryListsTheCollectiveInFlight) {
  auto comm = dist_world("wd_reg");
  std::vector<ActiveCollective> seen;
  std::mutex mutex;
  {
    CollectiveWatchdog dog({0, 0.2}, [&](const std::string&) {
      std::lock_guard<std::mutex> lock(mutex);
      seen = active_collectives();
    });
    if (comm->rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(800));
    int64_t v = 1;
    comm->allreduce(&v, 1);
    EXPECT_EQ(v, comm->size());
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (comm->rank() != 0) {
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_EQ(seen[0].comm, "wd_reg");
    EXPECT_EQ(seen[0].kind, CollectiveKind::Alltoallv);
    EXPECT_EQ(seen[0].op, CollectiveOp::Allreduce);
    EXPECT_EQ(seen[0].elem_size, 8);
    EXPECT_EQ(seen[0].seq, 1);
    EXPECT_GE(seen[0].seconds, 0.2);
  }
}
