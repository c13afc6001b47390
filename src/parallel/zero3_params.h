// ZeRO-3 (dist.zero = 3): parameters fully sharded. Each rank keeps resident only its shard of the
// parameters — the elements its optimizer steps, 1/P of every gradient bucket (GradSync's chunk
// of it: dense buckets over the data-parallel ranks, expert buckets over the expert's
// data-parallel group) — in the flat parameter buffer at their own offsets. The model asks for a
// unit (the embedding, a block, the head: TrainableModel::unit_starts) before it computes with
// it; its buckets are all-gathered into the buffer, on the communication thread when there is
// one, and the unit the model names next is gathered there meanwhile (prefetch). Released, a
// unit's whole pages outside this rank's shard go back to the system (madvise MADV_DONTNEED); the
// partial pages at the edges of its shard and of the unit stay.
//
// Gradients go as under ZeRO-2 (parallel/zero2_reducer.h), with buckets cut at the unit
// boundaries (GradSyncConfig::unit_starts), so that a unit's gather and its reduce-scatter are
// whole buckets. After the optimizer step nothing is gathered: the next forward gathers unit by
// unit. The gathered values are the bits the owners hold, so forward and backward compute what
// ZeRO-1's whole copy computes.
#pragma once
#include <cstdint>
#include <vector>

#include "model/trainable.h"
#include "parallel/comm_thread.h"
#include "parallel/grad_sync.h"

namespace moetrain {

class Zero3Params final : public ParamUnits {
 public:
  // sync: the gradient buckets, cut at `unit_starts`; params: the flat buffer of `size` floats;
  // thread: where gathers run (null: inline, when the model asks). All outlive this object.
  Zero3Params(GradSync& sync, float* params, int64_t size, std::vector<int64_t> unit_starts,
              CommThread* thread);

  // Collective over every bucket's group, like the gathers themselves: every rank calls acquire
  // and release for the same units in the same order (the model's forward and backward do).
  void acquire(int64_t unit, int64_t next) override;
  void release(int64_t unit) override;
  // Collective. Every unit in place (a checkpoint's write, a caller reading whole parameters).
  void acquire_all();
  // Every unit back to this rank's shard (after the optimizer step, a load). Local.
  void release_all();

  int64_t units() const { return static_cast<int64_t>(units_.size()); }
  // Unit u's flat range [begin, end), in floats.
  FlatRange range(int64_t u) const { return units_[static_cast<std::size_t>(u)].range; }

 private:
  enum class State { Released, Posted, Present };
  struct Unit {
    std::vector<std::size_t> buckets;  // the buckets holding its elements
    FlatRange range;                   // its flat range
    std::vector<FlatRange> drop;       // its ranges outside this rank's shard
    State state = State::Released;
    CommThread::Ticket ticket = 0;
  };
  void post(int64_t u);
  void gather(int64_t u);  // on the thread that runs it
  void drop(int64_t u);

  GradSync& sync_;
  float* params_;
  CommThread* thread_;
  std::vector<Unit> units_;
};

}  // namespace moetrain
