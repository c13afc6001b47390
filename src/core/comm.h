// One interface for the collectives the distributed trainer and the expert-parallel MoE layer use.
// Two backends: local (one process; every collective is a no-op or a copy) and MPI
// (parallel/comm_mpi.cpp, the only file that includes mpi.h). A backend implements a few
// byte-moving primitives; reductions are built on them here, so every backend sums the same way:
//
//   reduce_scatter: every rank sends chunk q of its input to rank q (one all-to-all), and rank q
//                   adds the P contributions in rank order 0, 1, ..., P−1.
//   allreduce:      reduce_scatter over P balanced chunks, then an all-gather of the sums.
//
// The result is reproducible run to run, identical in every bit on every rank, and independent of
// which algorithm the MPI library would have picked for its own reductions.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace moetrain {

enum class ReduceOp { Sum, Max };

// One options struct per collective, with defaults (as c10d does); `name` only labels errors.
struct BarrierOptions {};
struct AllreduceOptions {
  ReduceOp op = ReduceOp::Sum;
};
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::Sum;
};
struct AllgatherOptions {};
struct AlltoallvOptions {};
struct BroadcastOptions {
  int root = 0;
};
struct SplitOptions {
  std::string name;  // traffic class of the new communicator, for messages
};

// Point to point: a message's tag (0 … 32767) tells apart what one peer sends another.
struct P2pOptions {
  int tag = 0;
};

// A nonblocking send or receive. Until wait() returns, a send's buffer must stay unchanged and a
// receive's unread. Destroying one that was not waited for waits for it.
class Transfer {
 public:
  virtual ~Transfer() = default;
  virtual void wait() = 0;
};

// Bytes [offset, offset + bytes) of a buffer.
struct ByteBlock {
  int64_t offset = 0, bytes = 0;
};

class Comm {
 public:
  virtual ~Comm() = default;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  // "mpi" or "local".
  virtual const char* backend() const = 0;

  virtual void barrier(const BarrierOptions& opts = {}) = 0;

  // Byte all-to-all: sends send[send_displs[q], + send_counts[q]) to rank q and receives rank
  // q's bytes into recv[recv_displs[q], + recv_counts[q]). Every span has size() entries; any
  // count may be 0. The caller must know the receive counts (exchange them first).
  virtual void alltoallv(void* recv, std::span<const int64_t> recv_counts,
                         std::span<const int64_t> recv_displs, const void* send,
                         std::span<const int64_t> send_counts, std::span<const int64_t> send_displs,
                         const AlltoallvOptions& opts = {}) = 0;
  // alltoallv where each peer's message is gathered from, and scattered into, lists of blocks:
  // the bytes for rank q are send's send_blocks[q] one after another, and rank q's bytes fill
  // recv's recv_blocks[q] in order (the sizes must agree pairwise). MPI datatypes do the gather
  // and scatter (MPI_Alltoallw), which saves a packing copy but may move bytes less directly
  // than alltoallv: use alltoallv when every message is one run.
  virtual void alltoallv_blocks(void* recv, std::span<const std::vector<ByteBlock>> recv_blocks,
                                const void* send,
                                std::span<const std::vector<ByteBlock>> send_blocks,
                                const AlltoallvOptions& opts = {}) = 0;
  // Byte all-gather: rank q's counts[q] bytes from `send` land at recv + displs[q] on every rank.
  virtual void allgatherv(void* recv, std::span<const int64_t> counts,
                          std::span<const int64_t> displs, const void* send,
                          const AllgatherOptions& opts = {}) = 0;
  // data (bytes) on every rank = data on opts.root.
  virtual void broadcast(void* data, int64_t bytes, const BroadcastOptions& opts = {}) = 0;

  // Point to point (pipeline stages): `bytes` to or from rank `peer`. Messages from one rank to
  // another with the same tag arrive in the order they were sent; the receiver names the sender,
  // the tag and the exact byte count. One process: a rank sends to itself, and a receive takes
  // what was sent before it (a receive of nothing sent would wait forever: it throws).
  virtual std::unique_ptr<Transfer> isend(const void* data, int64_t bytes, int peer,
                                          const P2pOptions& opts = {}) = 0;
  virtual std::unique_ptr<Transfer> irecv(void* data, int64_t bytes, int peer,
                                          const P2pOptions& opts = {}) = 0;
  void send(const void* data, int64_t bytes, int peer, const P2pOptions& opts = {}) {
    isend(data, bytes, peer, opts)->wait();
  }
  void recv(void* data, int64_t bytes, int peer, const P2pOptions& opts = {}) {
    irecv(data, bytes, peer, opts)->wait();
  }

  // Ranks with the same color form a new communicator, ordered by (key, rank). color ≥ 0.
  virtual std::unique_ptr<Comm> split(int color, int key, const SplitOptions& opts) = 0;
  // The same ranks on a separate channel: each traffic class gets its own, so messages of one
  // class never match those of another.
  virtual std::unique_ptr<Comm> dup(const std::string& name) = 0;
  // The ranks that share this machine's memory, ordered by rank (MPI_Comm_split_type).
  virtual std::unique_ptr<Comm> split_shared(const SplitOptions& opts) = 0;

  // data (n) = elementwise op over ranks, identical bits on every rank.
  void allreduce(float* data, int64_t n, const AllreduceOptions& opts = {});
  void allreduce(double* data, int64_t n, const AllreduceOptions& opts = {});
  void allreduce(int64_t* data, int64_t n, const AllreduceOptions& opts = {});
  // out (counts[rank]) = op over ranks, in rank order, of chunk `rank` of in (Σ counts), where
  // chunk q starts at Σ_{p<q} counts[p]. counts has size() entries.
  void reduce_scatter(float* out, const float* in, std::span<const int64_t> counts,
                      const ReduceScatterOptions& opts = {});
  void reduce_scatter(double* out, const double* in, std::span<const int64_t> counts,
                      const ReduceScatterOptions& opts = {});
  void reduce_scatter(int64_t* out, const int64_t* in, std::span<const int64_t> counts,
                      const ReduceScatterOptions& opts = {});
  // Element all-gather: rank q's counts[q] elements of `send` are placed one after another in
  // recv (Σ counts) in rank order.
  template <class T>
  void allgather(T* recv, const T* send, std::span<const int64_t> counts,
                 const AllgatherOptions& opts = {}) {
    std::vector<int64_t> bytes(counts.size()), displs(counts.size());
    int64_t at = 0;
    for (std::size_t q = 0; q < counts.size(); ++q) {
      bytes[q] = counts[q] * static_cast<int64_t>(sizeof(T));
      displs[q] = at;
      at += bytes[q];
    }
    allgatherv(recv, bytes, displs, send, opts);
  }
  // Every rank's single value, in rank order.
  std::vector<int64_t> allgather_one(int64_t value);
  // Every rank's `mine` (the same length on every rank), in rank order: rank q's values at
  // [q·n, (q+1)·n) of the result.
  std::vector<double> allgather_same(std::span<const double> mine);

 protected:
  Comm(int rank, int size, std::string name) : rank_(rank), size_(size), name_(std::move(name)) {}
  // Throws unless a span argument of `what` has size() entries of non-negative counts.
  void check_counts(std::span<const int64_t> counts, const char* what) const;
  // check_counts on each of alltoallv's four count and displacement spans.
  void check_alltoallv_args(std::span<const int64_t> recv_counts,
                            std::span<const int64_t> recv_displs,
                            std::span<const int64_t> send_counts,
                            std::span<const int64_t> send_displs) const;
  // Throws unless a send or receive (`what`) names a peer in [0, size()), a tag in [0, 32767]
  // and `bytes` ≥ 0 at a buffer.
  void check_p2p(const void* data, int64_t bytes, int peer, const P2pOptions& opts,
                 const char* what) const;

 private:
  template <class T>
  void reduce_scatter_impl(T* out, const T* in, std::span<const int64_t> counts, ReduceOp op);
  template <class T>
  void allreduce_impl(T* data, int64_t n, ReduceOp op);

  int rank_, size_;
  std::string name_;
};

// Chunk q of n elements split over P parts: [n·q/P, n·(q+1)/P).
inline int64_t chunk_begin(int64_t n, int q, int P) {
  return n * q / P;
}

// How collectives called on this thread wait for their peers. By default they block inside MPI
// (lowest latency; Open MPI spins). A communication thread turns polite polling on: nonblocking
// collectives tested with short sleeps, so that waiting for peers that still compute costs this
// process's compute threads no core.
void comm_poll_politely(bool on);
bool comm_polls_politely();

// A one-process communicator: every collective is a copy or a no-op.
std::unique_ptr<Comm> make_local_comm(const std::string& name = "local");

// The typed operation a primitive belongs to, when Comm built it from primitives.
enum class CollectiveOp : int32_t { None, Allreduce, ReduceScatter, AllgatherOne };
const char* collective_op_name(CollectiveOp op);

// Names the typed operation (and its element size) of the primitives this thread issues while it
// lives; the outermost scope wins (allreduce = reduce_scatter + all-gather stays "allreduce").
class CollectiveOpScope {
 public:
  CollectiveOpScope(CollectiveOp op, int32_t elem_size);
  ~CollectiveOpScope();
  CollectiveOpScope(const CollectiveOpScope&) = delete;
  CollectiveOpScope& operator=(const CollectiveOpScope&) = delete;

 private:
  bool outer_;
};
// The operation of the innermost live scope on this thread (None outside any), and its element
// size: what the MPI backend's watchdog names when a primitive hangs.
CollectiveOp current_collective_op(int64_t* elem_size);

}  // namespace moetrain
