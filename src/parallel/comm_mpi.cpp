// The MPI backend: every call's return code is checked and turned into an Error naming the call,
// the communicator and MPI's own message.
#include "parallel/comm_mpi.h"

#include <mpi.h>

#include <chrono>
#include <climits>
#include <string_view>
#include <cstdlib>
#include <thread>

#include "core/check.h"
#include "core/profile.h"
#include "parallel/watchdog.h"

namespace moetrain::mpi {

namespace {

std::string error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<std::size_t>(len));
}

#define MOETRAIN_MPI(call, comm_name)                                                          \
  do {                                                                                         \
    int rc_ = (call);                                                                          \
    MOETRAIN_CHECK(rc_ == MPI_SUCCESS, "{} on communicator '{}' failed: {}", #call, comm_name, \
                   error_text(rc_));                                                           \
  } while (0)

int to_int(int64_t v, const char* what, const std::string& comm) {
  MOETRAIN_CHECK(v >= 0 && v <= INT_MAX,
                 "{} on communicator '{}': {} does not fit MPI's int counts (max {}); use smaller "
                 "buckets or fewer tokens per step",
                 what, comm, v, INT_MAX);
  return static_cast<int>(v);
}

// The largest power-of-two unit (≤ 64 bytes) dividing every count and displacement, so that
// byte counts up to 64·INT_MAX fit MPI's int arguments.
int common_unit(std::initializer_list<std::span<const int64_t>> lists) {
  int64_t acc = 64;
  for (auto list : lists)
    for (int64_t v : list)
      while (acc > 1 && v % acc != 0) acc /= 2;
  return static_cast<int>(acc);
}

int64_t sum(std::span<const int64_t> v) {
  int64_t total = 0;
  for (int64_t x : v) total += x;
  return total;
}

MPI_Datatype unit_type(int unit) {
  // Built once per unit and kept for the process: MPI frees them at finalize.
  static MPI_Datatype types[7] = {MPI_DATATYPE_NULL, MPI_DATATYPE_NULL, MPI_DATATYPE_NULL,
                                  MPI_DATATYPE_NULL, MPI_DATATYPE_NULL, MPI_DATATYPE_NULL,
                                  MPI_DATATYPE_NULL};
  int i = 0;
  while ((1 << i) < unit) ++i;
  if (i == 0) return MPI_BYTE;
  if (types[i] == MPI_DATATYPE_NULL) {
    MOETRAIN_MPI(MPI_Type_contiguous(unit, MPI_BYTE, &types[i]), "-");
    MOETRAIN_MPI(MPI_Type_commit(&types[i]), "-");
  }
  return types[i];
}

std::vector<int> scaled(std::span<const int64_t> v, int unit, const char* what,
                        const std::string& comm) {
  std::vector<int> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = to_int(v[i] / unit, what, comm);
  return out;
}

// Completes a nonblocking collective by polling MPI_Test: busily for the first 50 µs (short
// exchanges end there), then with 50 µs sleeps, so that a thread waiting for peers that are still
// computing does not take a core from this process's compute. Open MPI has no progress thread:
// the message moves inside these calls.
int wait_polling(MPI_Request& request) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  int done = 0;
  for (;;) {
    int rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS || done) return rc;
    if (Clock::now() - start > std::chrono::microseconds(50))
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// A collective as the blocking call, or on a thread that polls politely (comm_polls_politely)
// as the nonblocking call (which sets request_) completed by wait_polling.
#define MOETRAIN_MPI_COLLECTIVE(blocking, nonblocking, comm_name) \
  do {                                                            \
    if (comm_polls_politely()) {                                  \
      MPI_Request request_ = MPI_REQUEST_NULL;                    \
      MOETRAIN_MPI(nonblocking, comm_name);                       \
      MOETRAIN_MPI(wait_polling(request_), comm_name);            \
    } else {                                                      \
      MOETRAIN_MPI(blocking, comm_name);                          \
    }                                                             \
  } while (0)

// A nonblocking send or receive of an MpiComm, completed as collectives are: blocking in MPI, or
// polled politely on a communication thread, its wait under the collective watchdog (a peer that
// never sends is named, not waited for forever). A receive checks that the message filled it.
class MpiTransfer final : public Transfer {
 public:
  struct Peer {
    int rank, peer, tag;  // this process's rank in the communicator, the other's, the tag
    int64_t bytes;
  };
  MpiTransfer(std::string comm, const char* call, int count, MPI_Datatype type, Peer p)
      : comm_(std::move(comm)), call_(call), count_(count), type_(type), p_(p) {}
  ~MpiTransfer() override {
    // Abandoned (an error elsewhere): the buffer stays MPI's until the transfer ends.
    if (request != MPI_REQUEST_NULL) MPI_Wait(&request, MPI_STATUS_IGNORE);
  }
  void wait() override {
    if (request == MPI_REQUEST_NULL) return;
    const bool receiving = std::string_view(call_) == "MPI_Irecv";
    CollectiveScope scope(comm_, p_.rank, p_.tag,
                          receiving ? CollectiveKind::Recv : CollectiveKind::Send, p_.bytes, 0,
                          p_.peer);
    MPI_Status status;
    int rc = MPI_SUCCESS;
    if (comm_polls_politely()) {
      using Clock = std::chrono::steady_clock;
      const auto start = Clock::now();
      int done = 0;
      while ((rc = MPI_Test(&request, &done, &status)) == MPI_SUCCESS && !done)
        if (Clock::now() - start > std::chrono::microseconds(50))
          std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      rc = MPI_Wait(&request, &status);
    }
    MOETRAIN_CHECK(rc == MPI_SUCCESS, "{} on communicator '{}' failed: {}", call_, comm_,
                   error_text(rc));
    if (receiving) {
      int got = 0;
      MPI_Get_count(&status, type_, &got);
      MOETRAIN_CHECK(got == count_,
                     "MPI_Irecv on communicator '{}': the message from rank {} (tag {}) has {} "
                     "units, {} expected",
                     comm_, status.MPI_SOURCE, status.MPI_TAG, got, count_);
    }
  }
  MPI_Request request = MPI_REQUEST_NULL;

 private:
  std::string comm_;
  const char* call_;
  int count_;
  MPI_Datatype type_;
  Peer p_;
};

class MpiComm;

// One collective call of an MpiComm: registered with the watchdog for its lifetime, and with
// --debug-collectives checked against the other ranks' calls before any data moves.
class MpiCall {
 public:
  MpiCall(MpiComm& comm, CollectiveKind kind, int64_t bytes, int64_t agree = 0);
  // With --debug-collectives: every rank's send count to each peer equals that peer's receive
  // count from it (bytes, one entry per rank).
  void check_pairwise(std::span<const int64_t> send_bytes, std::span<const int64_t> recv_bytes);

 private:
  // First: the whole call, the debug check included.
  PhaseScope phase_{Phase::Collective, PhaseScope::OutermostOnly{}};
  MpiComm& comm_;
  CollectiveScope scope_;
};

class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm comm, int rank, int size, std::string name)
      : Comm(rank, size, std::move(name)), comm_(comm) {}

  ~MpiComm() override {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  static std::unique_ptr<Comm> wrap(MPI_Comm comm, const std::string& name) {
    MOETRAIN_MPI(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), name);
    int rank = 0, size = 0;
    MOETRAIN_MPI(MPI_Comm_rank(comm, &rank), name);
    MOETRAIN_MPI(MPI_Comm_size(comm, &size), name);
    return std::make_unique<MpiComm>(comm, rank, size, name);
  }

  const char* backend() const override { return "mpi"; }

  void barrier(const BarrierOptions&) override {
    MpiCall call(*this, CollectiveKind::Barrier, 0);
    MOETRAIN_MPI_COLLECTIVE(MPI_Barrier(comm_), MPI_Ibarrier(comm_, &request_), name());
  }

  void alltoallv(void* recv, std::span<const int64_t> recv_counts,
                 std::span<const int64_t> recv_displs, const void* send,
                 std::span<const int64_t> send_counts, std::span<const int64_t> send_displs,
                 const AlltoallvOptions&) override {
    check_alltoallv_args(recv_counts, recv_displs, send_counts, send_displs);
    const int unit = common_unit({recv_counts, recv_displs, send_counts, send_displs});
    auto rc = scaled(recv_counts, unit, "alltoallv receive count", name());
    auto rd = scaled(recv_displs, unit, "alltoallv receive displacement", name());
    auto sc = scaled(send_counts, unit, "alltoallv send count", name());
    auto sd = scaled(send_displs, unit, "alltoallv send displacement", name());
    MpiCall call(*this, CollectiveKind::Alltoallv, sum(send_counts));
    call.check_pairwise(send_counts, recv_counts);
    MPI_Datatype type = unit_type(unit);
    MOETRAIN_MPI_COLLECTIVE(
        MPI_Alltoallv(send, sc.data(), sd.data(), type, recv, rc.data(), rd.data(), type, comm_),
        MPI_Ialltoallv(send, sc.data(), sd.data(), type, recv, rc.data(), rd.data(), type, comm_,
                       &request_),
        name());
  }

  void alltoallv_blocks(void* recv, std::span<const std::vector<ByteBlock>> recv_blocks,
                        const void* send, std::span<const std::vector<ByteBlock>> send_blocks,
                        const AlltoallvOptions&) override {
    const int P = size();
    MOETRAIN_CHECK(
        static_cast<int>(recv_blocks.size()) == P && static_cast<int>(send_blocks.size()) == P,
        "alltoallv_blocks on '{}': {} and {} block lists, expected one per rank ({})", name(),
        recv_blocks.size(), send_blocks.size(), P);
    std::vector<int64_t> send_bytes(P), recv_bytes(P);
    for (int q = 0; q < P; ++q) {
      for (const ByteBlock& b : send_blocks[q]) send_bytes[q] += b.bytes;
      for (const ByteBlock& b : recv_blocks[q]) recv_bytes[q] += b.bytes;
    }
    MpiCall call(*this, CollectiveKind::AlltoallvBlocks, sum(send_bytes));
    call.check_pairwise(send_bytes, recv_bytes);
    // One hindexed type per peer and direction, displacements from the buffer's start.
    std::vector<MPI_Datatype> stypes(P, MPI_BYTE), rtypes(P, MPI_BYTE);
    std::vector<int> scounts(P, 0), rcounts(P, 0), zeros(P, 0);
    auto make = [&](const std::vector<ByteBlock>& blocks, MPI_Datatype& type, int& count) {
      std::vector<int> lengths;
      std::vector<MPI_Aint> displs;
      for (const ByteBlock& b : blocks) {
        MOETRAIN_CHECK(b.offset >= 0 && b.bytes >= 0, "alltoallv_blocks on '{}': block [{}, +{})",
                       name(), b.offset, b.bytes);
        if (b.bytes == 0) continue;
        lengths.push_back(to_int(b.bytes, "alltoallv_blocks block", name()));
        displs.push_back(static_cast<MPI_Aint>(b.offset));
      }
      if (lengths.empty()) return;
      MOETRAIN_MPI(MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(),
                                            displs.data(), MPI_BYTE, &type),
                   name());
      MOETRAIN_MPI(MPI_Type_commit(&type), name());
      count = 1;
    };
    for (int q = 0; q < P; ++q) {
      make(send_blocks[q], stypes[q], scounts[q]);
      make(recv_blocks[q], rtypes[q], rcounts[q]);
    }
    int rc = MPI_SUCCESS;
    if (comm_polls_politely()) {
      MPI_Request request = MPI_REQUEST_NULL;
      rc = MPI_Ialltoallw(send, scounts.data(), zeros.data(), stypes.data(), recv, rcounts.data(),
                          zeros.data(), rtypes.data(), comm_, &request);
      if (rc == MPI_SUCCESS) rc = wait_polling(request);
    } else {
      rc = MPI_Alltoallw(send, scounts.data(), zeros.data(), stypes.data(), recv, rcounts.data(),
                         zeros.data(), rtypes.data(), comm_);
    }
    // Freed once the exchange is complete (MPI keeps committed types alive while in use anyway).
    for (int q = 0; q < P; ++q) {
      if (stypes[q] != MPI_BYTE) MPI_Type_free(&stypes[q]);
      if (rtypes[q] != MPI_BYTE) MPI_Type_free(&rtypes[q]);
    }
    MOETRAIN_CHECK(rc == MPI_SUCCESS, "MPI_Alltoallw on communicator '{}' failed: {}", name(),
                   error_text(rc));
  }

  void allgatherv(void* recv, std::span<const int64_t> counts, std::span<const int64_t> displs,
                  const void* send, const AllgatherOptions&) override {
    check_counts(counts, "allgatherv counts");
    check_counts(displs, "allgatherv displacements");
    const int unit = common_unit({counts, displs});
    auto c = scaled(counts, unit, "allgatherv count", name());
    auto d = scaled(displs, unit, "allgatherv displacement", name());
    MpiCall call(*this, CollectiveKind::Allgatherv, sum(counts), hash_sizes(counts));
    MPI_Datatype type = unit_type(unit);
    MOETRAIN_MPI_COLLECTIVE(
        MPI_Allgatherv(send, c[rank()], type, recv, c.data(), d.data(), type, comm_),
        MPI_Iallgatherv(send, c[rank()], type, recv, c.data(), d.data(), type, comm_, &request_),
        name());
  }

  void broadcast(void* data, int64_t bytes, const BroadcastOptions& opts) override {
    MOETRAIN_CHECK(opts.root >= 0 && opts.root < size(),
                   "broadcast on '{}': root {} outside [0, {})", name(), opts.root, size());
    MOETRAIN_CHECK(bytes >= 0 && (bytes == 0 || data), "broadcast on '{}': {} bytes at {}", name(),
                   bytes, data);
    const int unit = common_unit({std::span<const int64_t>(&bytes, 1)});
    const int count = to_int(bytes / unit, "broadcast size", name());
    const int64_t shape[2] = {bytes, opts.root};
    MpiCall call(*this, CollectiveKind::Broadcast, bytes, hash_sizes(shape));
    MOETRAIN_MPI_COLLECTIVE(MPI_Bcast(data, count, unit_type(unit), opts.root, comm_),
                            MPI_Ibcast(data, count, unit_type(unit), opts.root, comm_, &request_),
                            name());
  }

  std::unique_ptr<Transfer> isend(const void* data, int64_t bytes, int peer,
                                  const P2pOptions& opts) override {
    return start(const_cast<void*>(data), bytes, peer, opts, true);
  }
  std::unique_ptr<Transfer> irecv(void* data, int64_t bytes, int peer,
                                  const P2pOptions& opts) override {
    return start(data, bytes, peer, opts, false);
  }

  std::unique_ptr<Comm> split(int color, int key, const SplitOptions& opts) override {
    MOETRAIN_CHECK(color >= 0, "split of '{}': color {} must be >= 0", name(), color);
    MpiCall call(*this, CollectiveKind::Split, 0);
    MPI_Comm out = MPI_COMM_NULL;
    MOETRAIN_MPI(MPI_Comm_split(comm_, color, key, &out), name());
    return wrap(out, opts.name.empty() ? name() : opts.name);
  }

  std::unique_ptr<Comm> split_shared(const SplitOptions& opts) override {
    MpiCall call(*this, CollectiveKind::SplitShared, 0);
    MPI_Comm out = MPI_COMM_NULL;
    MOETRAIN_MPI(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank(), MPI_INFO_NULL, &out),
                 name());
    return wrap(out, opts.name.empty() ? name() : opts.name);
  }

  std::unique_ptr<Comm> dup(const std::string& name) override {
    MpiCall call(*this, CollectiveKind::Dup, 0);
    MPI_Comm out = MPI_COMM_NULL;
    MOETRAIN_MPI(MPI_Comm_dup(comm_, &out), this->name());
    return wrap(out, name);
  }

 private:
  friend class MpiCall;
  // One MPI_Isend or MPI_Irecv, in the largest unit that divides the bytes.
  std::unique_ptr<Transfer> start(void* data, int64_t bytes, int peer, const P2pOptions& opts,
                                  bool sending) {
    check_p2p(data, bytes, peer, opts, sending ? "send" : "receive");
    const int unit = common_unit({std::span<const int64_t>(&bytes, 1)});
    const int count = to_int(bytes / unit, sending ? "send size" : "receive size", name());
    const MPI_Datatype type = unit_type(unit);
    auto t = std::make_unique<MpiTransfer>(name(), sending ? "MPI_Isend" : "MPI_Irecv", count,
                                           type, MpiTransfer::Peer{rank(), peer, opts.tag, bytes});
    if (sending) {
      MOETRAIN_MPI(MPI_Isend(data, count, type, peer, opts.tag, comm_, &t->request), name());
    } else {
      MOETRAIN_MPI(MPI_Irecv(data, count, type, peer, opts.tag, comm_, &t->request), name());
    }
    return t;
  }
  MPI_Comm comm_;
  int64_t seq_ = 0;  // collectives issued on this communicator
};

MpiCall::MpiCall(MpiComm& comm, CollectiveKind kind, int64_t bytes, int64_t agree)
    : comm_(comm), scope_(comm.name(), comm.rank(), ++comm.seq_, kind, bytes, agree) {
  if (!debug_collectives()) return;
  const CollectiveFingerprint& mine = scope_.fingerprint();
  std::vector<CollectiveFingerprint> all(static_cast<std::size_t>(comm.size()));
  constexpr int kBytes = sizeof(CollectiveFingerprint);
  MOETRAIN_MPI_COLLECTIVE(
      MPI_Allgather(&mine, kBytes, MPI_BYTE, all.data(), kBytes, MPI_BYTE, comm.comm_),
      MPI_Iallgather(&mine, kBytes, MPI_BYTE, all.data(), kBytes, MPI_BYTE, comm.comm_, &request_),
      comm.name());
  std::string mismatch = fingerprint_mismatch(all, comm.rank(), comm.name());
  MOETRAIN_CHECK(mismatch.empty(), "{}", mismatch);
}

void MpiCall::check_pairwise(std::span<const int64_t> send_bytes,
                             std::span<const int64_t> recv_bytes) {
  if (!debug_collectives()) return;
  const int P = comm_.size();
  std::vector<int64_t> expected(static_cast<std::size_t>(P));  // what each peer will send here
  MOETRAIN_MPI_COLLECTIVE(
      MPI_Alltoall(send_bytes.data(), 1, MPI_INT64_T, expected.data(), 1, MPI_INT64_T, comm_.comm_),
      MPI_Ialltoall(send_bytes.data(), 1, MPI_INT64_T, expected.data(), 1, MPI_INT64_T, comm_.comm_,
                    &request_),
      comm_.name());
  // The first disagreement seen by each rank, {sender, bytes sent, bytes expected}, shared so
  // that every rank stops (a rank that went on into the exchange would wait forever).
  int64_t mine[3] = {-1, 0, 0};
  for (int q = 0; q < P && mine[0] < 0; ++q)
    if (expected[q] != recv_bytes[q]) mine[0] = q, mine[1] = expected[q], mine[2] = recv_bytes[q];
  std::vector<int64_t> all(static_cast<std::size_t>(3 * P));
  MOETRAIN_MPI_COLLECTIVE(
      MPI_Allgather(mine, 3, MPI_INT64_T, all.data(), 3, MPI_INT64_T, comm_.comm_),
      MPI_Iallgather(mine, 3, MPI_INT64_T, all.data(), 3, MPI_INT64_T, comm_.comm_, &request_),
      comm_.name());
  for (int r = 0; r < P; ++r) {
    const int64_t* d = all.data() + 3 * r;
    MOETRAIN_CHECK(d[0] < 0,
                   "collective mismatch on communicator '{}': in {} #{} rank {} sends {} bytes to "
                   "rank {}, which expects {}",
                   comm_.name(),
                   collective_kind_name(static_cast<CollectiveKind>(scope_.fingerprint().kind)),
                   scope_.fingerprint().seq, d[0], d[1], r, d[2]);
  }
}

int g_local_size = 0, g_local_rank = 0;  // 0: not asked yet

// The ranks sharing this machine's memory; computed on first use, whichever code started MPI.
void find_local() {
  if (g_local_size > 0) return;
  MOETRAIN_CHECK(initialized(), "MPI is not initialised: start the program with mpirun");
  MPI_Comm node = MPI_COMM_NULL;
  MOETRAIN_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
               "world");
  MOETRAIN_MPI(MPI_Comm_size(node, &g_local_size), "node");
  MOETRAIN_MPI(MPI_Comm_rank(node, &g_local_rank), "node");
  MOETRAIN_MPI(MPI_Comm_free(&node), "node");
}

}  // namespace

bool launched() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    if (std::getenv(var)) return true;
  }
  return false;
}

bool initialized() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

void initialize(int* argc, char*** argv) {
  if (initialized()) return;
  int provided = 0;
  int rc = MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided);
  MOETRAIN_CHECK(rc == MPI_SUCCESS, "MPI_Init_thread failed: {}", error_text(rc));
  MOETRAIN_MPI(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "world");
  MOETRAIN_CHECK(provided >= MPI_THREAD_SERIALIZED,
                 "the MPI library provides thread level {}, below MPI_THREAD_SERIALIZED ({}) "
                 "which the trainer needs",
                 provided, MPI_THREAD_SERIALIZED);
}

std::unique_ptr<Comm> world(const std::string& name) {
  MOETRAIN_CHECK(initialized(), "MPI is not initialised: start the program with mpirun");
  MPI_Comm out = MPI_COMM_NULL;
  MOETRAIN_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &out), "world");
  return MpiComm::wrap(out, name);
}

int local_size() {
  find_local();
  return g_local_size;
}
int local_rank() {
  find_local();
  return g_local_rank;
}

void finalize() {
  if (initialized()) MPI_Finalize();
}

void abort(int code) {
  if (initialized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace moetrain::mpi
