#include "parallel/comm_on_thread.h"

#include "core/check.h"

namespace moetrain {

namespace {

class CommOnThread final : public Comm {
 public:
  CommOnThread(std::unique_ptr<Comm> inner, CommThread& thread)
      : Comm(inner->rank(), inner->size(), inner->name()),
        inner_(std::move(inner)),
        thread_(thread) {}

  const char* backend() const override { return inner_->backend(); }

  void barrier(const BarrierOptions& opts) override {
    run([&] { inner_->barrier(opts); });
  }
  void alltoallv(void* recv, std::span<const int64_t> recv_counts,
                 std::span<const int64_t> recv_displs, const void* send,
                 std::span<const int64_t> send_counts, std::span<const int64_t> send_displs,
                 const AlltoallvOptions& opts) override {
    run([&] {
      inner_->alltoallv(recv, recv_counts, recv_displs, send, send_counts, send_displs, opts);
    });
  }
  void alltoallv_blocks(void* recv, std::span<const std::vector<ByteBlock>> recv_blocks,
                        const void* send, std::span<const std::vector<ByteBlock>> send_blocks,
                        const AlltoallvOptions& opts) override {
    run([&] { inner_->alltoallv_blocks(recv, recv_blocks, send, send_blocks, opts); });
  }
  void allgatherv(void* recv, std::span<const int64_t> counts, std::span<const int64_t> displs,
                  const void* send, const AllgatherOptions& opts) override {
    run([&] { inner_->allgatherv(recv, counts, displs, send, opts); });
  }
  void broadcast(void* data, int64_t bytes, const BroadcastOptions& opts) override {
    run([&] { inner_->broadcast(data, bytes, opts); });
  }
  std::unique_ptr<Transfer> isend(const void*, int64_t, int, const P2pOptions&) override {
    MOETRAIN_FAIL("communicator '{}' on a communication thread: no point-to-point", name());
  }
  std::unique_ptr<Transfer> irecv(void*, int64_t, int, const P2pOptions&) override {
    MOETRAIN_FAIL("communicator '{}' on a communication thread: no point-to-point", name());
  }
  std::unique_ptr<Comm> split(int, int, const SplitOptions&) override {
    MOETRAIN_FAIL("communicator '{}' on a communication thread: split the inner one", name());
  }
  std::unique_ptr<Comm> dup(const std::string&) override {
    MOETRAIN_FAIL("communicator '{}' on a communication thread: dup the inner one", name());
  }
  std::unique_ptr<Comm> split_shared(const SplitOptions&) override {
    MOETRAIN_FAIL("communicator '{}' on a communication thread: split the inner one", name());
  }

 private:
  // The typed-operation label (CollectiveOpScope) is the caller thread's, so the thread's
  // primitives carry none: every rank's are unlabelled alike.
  template <class Fn>
  void run(Fn&& fn) {
    thread_.wait(thread_.post([&] { fn(); }));
  }

  std::unique_ptr<Comm> inner_;
  CommThread& thread_;
};

}  // namespace

std::unique_ptr<Comm> comm_on_thread(std::unique_ptr<Comm> inner, CommThread& thread) {
  return std::make_unique<CommOnThread>(std::move(inner), thread);
}

}  // namespace moetrain
