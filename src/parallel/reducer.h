// Gradient reduction between the last backward and the update step, as one interface: every
// trainer makes the same calls whatever the number of processes (llm.c's reduce returns at once on
// one rank). The local reducer is the identity; the MPI one (parallel/mpi_reducer.h) sums over
// the data-parallel ranks in buckets, plain or ZeRO-1; parallel/zero2_reducer.h is ZeRO-2. A trainer picks one at construction.
//
//   reducer.begin(grads)            before the step's last backward (overlapped reduction)
//   backward ...                    (the model's grads-ready hook may feed the reducer)
//   GradientShard& g = reducer.reduce(grads)
//   apply_update(g, comm, opts, [&] { reducer.update(params, grads, optimizer_step); })
#pragma once
#include <cstdint>
#include <optional>
#include <vector>
#include <span>

#include "optim/update.h"

namespace moetrain {

// grad.sparse_ratio's figures so far (parallel/sparse_grad.h): bytes the sparse buckets sent,
// values they reduced, entries of those that at least one rank sent, and Σ over entries of the
// ranks that sent each.
struct SparseReduceFigures {
  int64_t bytes = 0, values = 0, entries = 0, contributions = 0;
};

class GradReducer {
 public:
  virtual ~GradReducer() = default;
  // Before the step's last backward: reduction may start as backward finishes gradients.
  virtual void begin(float* grads) = 0;
  // Completes the reduction of grads (the flat buffer); returns the part of the summed gradient
  // this process is responsible for, valid until the next begin/reduce.
  virtual GradientShard& reduce(float* grads) = 0;
  // ZeRO-2: every micro-batch's gradients are reduced as its backward finishes them, not only the
  // last one's; begin_micro_batch / end_micro_batch then frame each backward but the step's last
  // (micro: its index), and each ends with that micro-batch's range of grads zero.
  virtual bool reduces_each_micro_batch() const { return false; }
  virtual void begin_micro_batch(float* /*grads*/, int64_t /*micro*/) {}
  virtual void end_micro_batch(float* /*grads*/) {}
  // Where the optimizer reads each of its pieces' gradients when they are not at the pieces'
  // offsets in the flat buffer (ZeRO-2: in the shard), in piece order; empty otherwise.
  virtual std::span<const float* const> piece_grads() const { return {}; }
  // After check_and_clip, before the optimizer step: the reduced, clipped part is put where the
  // optimizer reads it (ZeRO-1 unpacks its shard into grads; nothing to do otherwise).
  virtual void prepare_step(float* /*grads*/) {}
  // After the optimizer step (which updated what this process holds the state of): params made
  // whole again on every process (ZeRO-1's gather of the other shards; nothing otherwise).
  virtual void finish_step(float* /*params*/) {}
  // Whether finish_step changes parameters the optimizer step did not write (ZeRO-1's gather):
  // a copy the step kept of them is then stale.
  virtual bool gathers_params() const { return false; }
  // Seconds the calling thread has spent communicating so far: the reduction when it does not
  // overlap backward, and ZeRO-1's parameter gather. Work handed to a communication thread is
  // timed there (CommThread::busy_seconds), and the wait for it by whoever waits.
  virtual double inline_seconds() const = 0;
  // Bytes sent to other processes so far: reductions, gradient and parameter gathers.
  virtual int64_t bytes_sent() const = 0;
  // State the reduction carries from one step to the next (int8's error-feedback residual),
  // which a checkpoint must save for a bit-exact resume; null when there is none.
  virtual std::vector<float>* carried() { return nullptr; }
  // What carried() holds: "" for int8's residual, "sparse_ratio" for grad.sparse_ratio's.
  virtual const char* carried_kind() const { return ""; }
  // Sparse experts (optim/sparse_experts.h): before begin(), the step's mask by expert key;
  // buckets of inactive experts are neither sent nor gathered, their reduced values read 0.
  // Empty: every bucket is reduced. The local reducer has nothing to skip.
  virtual void set_active_experts(std::span<const uint8_t> /*active*/) {}
  // Bytes that skipped buckets would have sent, so far.
  virtual int64_t bytes_skipped() const { return 0; }
  // grad.sparse_ratio: what the sparse buckets did so far (zeros without them).
  virtual SparseReduceFigures sparse_figures() const { return {}; }
};

// One process: the gradients are already the sum; the whole buffer is this process's part.
class LocalGradReducer final : public GradReducer {
 public:
  explicit LocalGradReducer(int64_t n) : n_(n) {}
  void begin(float*) override {}
  GradientShard& reduce(float* grads) override { return shard_.emplace(grads, n_); }
  double inline_seconds() const override { return 0; }
  int64_t bytes_sent() const override { return 0; }

 private:
  int64_t n_;  // floats in the flat buffer
  std::optional<FlatGradient> shard_;
};

}  // namespace moetrain
