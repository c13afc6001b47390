#include "core/comm.h"

#include <algorithm>
#include <cstring>
#include <deque>

#include "core/buffer.h"
#include "core/check.h"

namespace moetrain {

void Comm::check_counts(std::span<const int64_t> counts, const char* what) const {
  MOETRAIN_CHECK(static_cast<int64_t>(counts.size()) == size_,
                 "{} on communicator '{}': {} entries given, expected one per rank ({})", what,
                 name_, counts.size(), size_);
  for (std::size_t q = 0; q < counts.size(); ++q) {
    MOETRAIN_CHECK(counts[q] >= 0, "{} on communicator '{}': entry {} is {}, must be >= 0", what,
                   name_, q, counts[q]);
  }
}

void Comm::check_alltoallv_args(std::span<const int64_t> recv_counts,
                                std::span<const int64_t> recv_displs,
                                std::span<const int64_t> send_counts,
                                std::span<const int64_t> send_displs) const {
  check_counts(recv_counts, "alltoallv receive counts");
  check_counts(recv_displs, "alltoallv receive displacements");
  check_counts(send_counts, "alltoallv send counts");
  check_counts(send_displs, "alltoallv send displacements");
}

void Comm::check_p2p(const void* data, int64_t bytes, int peer, const P2pOptions& opts,
                     const char* what) const {
  MOETRAIN_CHECK(peer >= 0 && peer < size_, "{} on communicator '{}': peer {} outside [0, {})",
                 what, name_, peer, size_);
  MOETRAIN_CHECK(opts.tag >= 0 && opts.tag <= 32767,
                 "{} on communicator '{}': tag {} outside [0, 32767]", what, name_, opts.tag);
  MOETRAIN_CHECK(bytes >= 0 && (bytes == 0 || data), "{} on communicator '{}': {} bytes at {}",
                 what, name_, bytes, data);
}

template <class T>
void Comm::reduce_scatter_impl(T* out, const T* in, std::span<const int64_t> counts, ReduceOp op) {
  check_counts(counts, "reduce_scatter");
  CollectiveOpScope scope(CollectiveOp::ReduceScatter, sizeof(T));
  const int P = size_;
  const int64_t mine = counts[rank_];
  constexpr auto kSize = static_cast<int64_t>(sizeof(T));
  std::vector<int64_t> send_counts(P), send_displs(P), recv_counts(P), recv_displs(P);
  int64_t at = 0;
  for (int q = 0; q < P; ++q) {
    send_counts[q] = counts[q] * kSize;
    send_displs[q] = at * kSize;
    at += counts[q];
    recv_counts[q] = mine * kSize;
    recv_displs[q] = static_cast<int64_t>(q) * mine * kSize;
  }
  // (P, mine): row q is rank q's contribution to this rank's chunk, all of it received. Kept by
  // the calling thread and never zero-filled: a gradient bucket's parts (up to the bucket's
  // 25 MiB) allocated afresh at each call were zeroed and then faulted in page by page, every
  // bucket of every step.
  thread_local GrowBuffer<sizeof(T)> scratch;
  T* parts = static_cast<T*>(scratch.grow(P * mine));
  alltoallv(parts, recv_counts, recv_displs, in, send_counts, send_displs);
  if (mine == 0) return;
  std::memcpy(out, parts, static_cast<std::size_t>(mine) * sizeof(T));
  for (int q = 1; q < P; ++q) {
    const T* src = parts + static_cast<int64_t>(q) * mine;
    if (op == ReduceOp::Sum) {
      for (int64_t i = 0; i < mine; ++i) out[i] += src[i];
    } else {
      for (int64_t i = 0; i < mine; ++i) out[i] = std::max(out[i], src[i]);
    }
  }
}

template <class T>
void Comm::allreduce_impl(T* data, int64_t n, ReduceOp op) {
  MOETRAIN_CHECK(n >= 0 && (n == 0 || data), "allreduce on '{}': n = {} with data {}", name_, n,
                 static_cast<const void*>(data));
  if (size_ == 1) return;
  CollectiveOpScope scope(CollectiveOp::Allreduce, sizeof(T));
  const int P = size_;
  std::vector<int64_t> counts(P);
  for (int q = 0; q < P; ++q) counts[q] = chunk_begin(n, q + 1, P) - chunk_begin(n, q, P);
  std::vector<T> mine(static_cast<std::size_t>(counts[rank_]));
  reduce_scatter_impl(mine.data(), data, counts, op);
  allgather(data, mine.data(), counts);
}

void Comm::allreduce(float* data, int64_t n, const AllreduceOptions& opts) {
  allreduce_impl(data, n, opts.op);
}
void Comm::allreduce(double* data, int64_t n, const AllreduceOptions& opts) {
  allreduce_impl(data, n, opts.op);
}
void Comm::allreduce(int64_t* data, int64_t n, const AllreduceOptions& opts) {
  allreduce_impl(data, n, opts.op);
}

void Comm::reduce_scatter(float* out, const float* in, std::span<const int64_t> counts,
                          const ReduceScatterOptions& opts) {
  reduce_scatter_impl(out, in, counts, opts.op);
}
void Comm::reduce_scatter(double* out, const double* in, std::span<const int64_t> counts,
                          const ReduceScatterOptions& opts) {
  reduce_scatter_impl(out, in, counts, opts.op);
}
void Comm::reduce_scatter(int64_t* out, const int64_t* in, std::span<const int64_t> counts,
                          const ReduceScatterOptions& opts) {
  reduce_scatter_impl(out, in, counts, opts.op);
}

std::vector<int64_t> Comm::allgather_one(int64_t value) {
  std::vector<int64_t> out(static_cast<std::size_t>(size_));
  std::vector<int64_t> ones(static_cast<std::size_t>(size_), 1);
  CollectiveOpScope scope(CollectiveOp::AllgatherOne, sizeof(int64_t));
  allgather(out.data(), &value, ones);
  return out;
}

std::vector<double> Comm::allgather_same(std::span<const double> mine) {
  const int64_t n = static_cast<int64_t>(mine.size());
  std::vector<double> out(static_cast<std::size_t>(n * size_));
  std::vector<int64_t> counts(static_cast<std::size_t>(size_), n);
  CollectiveOpScope scope(CollectiveOp::AllgatherOne, sizeof(double));
  allgather(out.data(), mine.data(), counts);
  return out;
}

namespace {

class LocalComm final : public Comm {
 public:
  explicit LocalComm(std::string name) : Comm(0, 1, std::move(name)) {}
  const char* backend() const override { return "local"; }
  void barrier(const BarrierOptions&) override {}

  void alltoallv(void* recv, std::span<const int64_t> recv_counts,
                 std::span<const int64_t> recv_displs, const void* send,
                 std::span<const int64_t> send_counts, std::span<const int64_t> send_displs,
                 const AlltoallvOptions&) override {
    check_alltoallv_args(recv_counts, recv_displs, send_counts, send_displs);
    MOETRAIN_CHECK(recv_counts[0] == send_counts[0],
                   "alltoallv on '{}': sending {} bytes to itself but expecting {}", name(),
                   send_counts[0], recv_counts[0]);
    copy(static_cast<char*>(recv) + recv_displs[0], static_cast<const char*>(send) + send_displs[0],
         send_counts[0]);
  }

  void alltoallv_blocks(void* recv, std::span<const std::vector<ByteBlock>> recv_blocks,
                        const void* send, std::span<const std::vector<ByteBlock>> send_blocks,
                        const AlltoallvOptions&) override {
    MOETRAIN_CHECK(recv_blocks.size() == 1 && send_blocks.size() == 1,
                   "alltoallv_blocks on '{}': {} and {} block lists for a world of 1", name(),
                   recv_blocks.size(), send_blocks.size());
    // Walk both lists at once: a run ends where either block ends.
    const auto& in = send_blocks[0];
    const auto& out = recv_blocks[0];
    std::size_t i = 0, o = 0;
    int64_t at_in = 0, at_out = 0;
    while (i < in.size() && o < out.size()) {
      const int64_t n = std::min(in[i].bytes - at_in, out[o].bytes - at_out);
      copy(static_cast<char*>(recv) + out[o].offset + at_out,
           static_cast<const char*>(send) + in[i].offset + at_in, n);
      at_in += n, at_out += n;
      if (at_in == in[i].bytes) ++i, at_in = 0;
      if (at_out == out[o].bytes) ++o, at_out = 0;
    }
    auto rest = [](const std::vector<ByteBlock>& v, std::size_t k, int64_t at) {
      int64_t n = -at;
      for (; k < v.size(); ++k) n += v[k].bytes;
      return n;
    };
    MOETRAIN_CHECK(rest(in, i, at_in) <= 0 && rest(out, o, at_out) <= 0,
                   "alltoallv_blocks on '{}': the send and receive blocks differ in size", name());
  }

  void allgatherv(void* recv, std::span<const int64_t> counts, std::span<const int64_t> displs,
                  const void* send, const AllgatherOptions&) override {
    check_counts(counts, "allgatherv counts");
    check_counts(displs, "allgatherv displacements");
    copy(static_cast<char*>(recv) + displs[0], send, counts[0]);
  }

  void broadcast(void* data, int64_t bytes, const BroadcastOptions& opts) override {
    MOETRAIN_CHECK(opts.root == 0, "broadcast on '{}': root {} outside a world of 1", name(),
                   opts.root);
    MOETRAIN_CHECK(bytes >= 0 && (bytes == 0 || data), "broadcast on '{}': {} bytes at {}", name(),
                   bytes, data);
  }

  // A message to itself waits in a queue per tag until a receive takes it.
  std::unique_ptr<Transfer> isend(const void* data, int64_t bytes, int peer,
                                  const P2pOptions& opts) override {
    check_p2p(data, bytes, peer, opts, "send");
    const char* p = static_cast<const char*>(data);
    pending_.push_back({opts.tag, std::vector<char>(p, p + bytes)});
    return std::make_unique<Done>();
  }
  std::unique_ptr<Transfer> irecv(void* data, int64_t bytes, int peer,
                                  const P2pOptions& opts) override {
    check_p2p(data, bytes, peer, opts, "receive");
    auto it = std::find_if(pending_.begin(), pending_.end(),
                           [&](const Message& m) { return m.tag == opts.tag; });
    MOETRAIN_CHECK(it != pending_.end(),
                   "receive on '{}' with tag {}: this one process sent nothing with that tag, so "
                   "the receive would wait forever",
                   name(), opts.tag);
    MOETRAIN_CHECK(static_cast<int64_t>(it->bytes.size()) == bytes,
                   "receive on '{}' with tag {}: {} bytes expected, {} were sent", name(),
                   opts.tag, bytes, it->bytes.size());
    copy(data, it->bytes.data(), bytes);
    pending_.erase(it);
    return std::make_unique<Done>();
  }

  std::unique_ptr<Comm> split(int color, int, const SplitOptions& opts) override {
    MOETRAIN_CHECK(color >= 0, "split of '{}': color {} must be >= 0", name(), color);
    return std::make_unique<LocalComm>(opts.name.empty() ? name() : opts.name);
  }
  std::unique_ptr<Comm> dup(const std::string& name) override {
    return std::make_unique<LocalComm>(name);
  }
  std::unique_ptr<Comm> split_shared(const SplitOptions& opts) override {
    return std::make_unique<LocalComm>(opts.name.empty() ? name() : opts.name);
  }

 private:
  struct Done final : Transfer {
    void wait() override {}
  };
  struct Message {
    int tag = 0;
    std::vector<char> bytes;
  };
  std::deque<Message> pending_;  // sent to itself, not yet received, in sending order

  static void copy(void* dst, const void* src, int64_t bytes) {
    // memmove: a caller may gather in place.
    if (bytes > 0 && dst != src) std::memmove(dst, src, static_cast<std::size_t>(bytes));
  }
};

}  // namespace

namespace {
thread_local bool t_poll_politely = false;
}  // namespace

void comm_poll_politely(bool on) {
  t_poll_politely = on;
}
bool comm_polls_politely() {
  return t_poll_politely;
}

std::unique_ptr<Comm> make_local_comm(const std::string& name) {
  return std::make_unique<LocalComm>(name);
}

const char* collective_op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::None:
      return "";
    case CollectiveOp::Allreduce:
      return "allreduce";
    case CollectiveOp::ReduceScatter:
      return "reduce_scatter";
    case CollectiveOp::AllgatherOne:
      return "allgather_one";
  }
  return "unknown operation";
}

namespace {
thread_local CollectiveOp t_op = CollectiveOp::None;
thread_local int32_t t_elem_size = 0;
}  // namespace

CollectiveOpScope::CollectiveOpScope(CollectiveOp op, int32_t elem_size)
    : outer_(t_op == CollectiveOp::None) {
  if (outer_) t_op = op, t_elem_size = elem_size;
}

CollectiveOpScope::~CollectiveOpScope() {
  if (outer_) t_op = CollectiveOp::None, t_elem_size = 0;
}

CollectiveOp current_collective_op(int64_t* elem_size) {
  *elem_size = t_elem_size;
  return t_op;
}

}  // namespace moetrain
