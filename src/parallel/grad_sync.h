// Data-parallel gradient reduction over the flat gradient buffer, in buckets. Every bucket is
// reduced as reduce-scatter then all-gather (Comm sums in rank order), so plain data parallelism
// and ZeRO-1 share one summation path and give the same bits:
//   plain DP: reduce_scatter → allgather_grads → (norm on the shard; unscale, clip in place
//             with scale_reduced) → full optimizer step
//   ZeRO-1:   reduce_scatter → (norm, clip on the shard) → unpack_shard → step on the shard only
//             → allgather_params
//   ZeRO-2:   reduce_scatter (each bucket's flat range cleared once reduced, bucket_done) →
//             (norm, clip on the shard) → step reading the shard itself → allgather_params
//             (parallel/zero2_reducer.h)
// Replicated parameters reduce over every rank (`dense` communicator); this rank's experts over
// its expert-data-parallel group (`expert`). Buckets are cut walking the buffer from its end,
// the order backward produces gradients in: the first bucket of each kind is small (1 MiB by
// default) so reduction can start early, the rest larger (25 MiB). A bucket holds pieces of one
// kind only and its P chunks are [n·q/P, n·(q+1)/P) of its packed elements; chunk q is rank q's
// shard. Every rank of a group cuts the same buckets, in the same order.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/comm.h"
#include "core/dtype.h"
#include "model/params.h"
#include "optim/sparse_experts.h"
#include "optim/update.h"
#include "parallel/comm_thread.h"
#include "parallel/grad_wire.h"
#include "parallel/groups.h"
#include "parallel/sparse_grad.h"

namespace moetrain {

struct GradSyncConfig {
  int64_t first_bucket_bytes = int64_t{1} << 20;
  int64_t bucket_bytes = int64_t{25} << 20;
  // What the gradient reduce-scatter and all-gather put on the wire. In bf16 every rank's
  // gradients are rounded to bf16 before they are sent (its own chunk too, so the sum is
  // symmetric in the ranks), summed in f32 in rank order, and the reduced chunks are all-gathered
  // as bf16 again (each rank's own chunk included, so every rank holds the same bits). Half the
  // bytes; bucket sizes stay in f32 bytes. Parameters (ZeRO-1) travel in f32.
  // int8 (core/block_quant.h): each chunk is quantised in blocks of 256 with error feedback
  // (residual() holds what quantising lost, per packed element this rank sends), the P parts are
  // dequantised and summed in f32 in rank order; under plain data parallelism the reduced chunk is
  // quantised again, with a second residual on the shard, and all-gathered as int8 (each rank's
  // own chunk replaced by what the others receive, so every rank holds the same bits). About a
  // quarter of the f32 bytes.
  GradWire wire = GradWire::F32;
  // Sparse experts: expert buckets are cut at expert boundaries (each holds one expert's rows
  // only, SyncRanges::expert_keyed), so a bucket of an inactive expert can be skipped.
  bool sparse_experts = false;
  // grad.sparse_ratio (parallel/sparse_grad.h), 0 = off: each expert bucket reduced over a group
  // of more than one rank sends only its top ceil(ratio·n) values with their positions (values in
  // f32, or bf16 with wire = BF16; int8 is refused), with error feedback; every rank sums the
  // group's lists into the whole bucket, which stands for both the reduce-scatter (this rank's
  // chunk) and the gather (nothing more is sent). Replicated buckets keep `wire`.
  double sparse_ratio = 0;
  // Flat offsets where units begin (ascending; ZeRO-3's gather units, parallel/zero3_params.h):
  // no bucket holds elements of two units. Empty: buckets are cut by size alone.
  std::vector<int64_t> unit_starts;
};

// Elements [offset, offset + size) of the flat buffer.
struct FlatRange {
  int64_t offset = 0, size = 0;
};

// The ranges of the flat buffer a rank reduces: everything outside the expert blocks (alignment
// gaps included), and this rank's experts within each (layer, projection) block.
struct SyncRanges {
  std::vector<FlatRange> dense;
  std::vector<FlatRange> expert;
  // This rank's expert tensors one by one with their keys (optim/sparse_experts.h), layout order.
  std::vector<ExpertPiece> expert_keyed;
};
SyncRanges sync_ranges(const ParamTable& layout, const ExpertShard& shard);

// A piece of this rank's shard: flat range and whether it is expert (EDP-reduced).
struct ShardPiece {
  FlatRange range;
  bool expert = false;
};

// As a GradientShard (optim/update.h) it is this rank's shard of the reduced gradient: the
// non-finite check and the norm read the shard, and scale() multiplies the shard and, under plain
// data parallelism, the reduced copy gathered into the flat buffer (the one the optimizer reads).
class GradSync final : public GradientShard {
 public:
  // dense, expert: communicators that must outlive this object.
  GradSync(const SyncRanges& ranges, Comm& dense, Comm& expert, const GradSyncConfig& cfg);

  struct Bucket {
    bool expert = false;
    std::vector<FlatRange> pieces;  // packing order
    int64_t size = 0;               // packed elements
    std::vector<int64_t> counts;    // (group size) chunk sizes
    int64_t chunk_begin = 0;        // this rank's chunk, in packed elements
    int64_t shard_offset = 0;       // where that chunk sits in the shard
    int64_t packed_offset = 0;      // Σ size of the buckets before it
    int64_t key = -1;               // sparse experts: the expert key of every piece, else -1
  };
  const std::vector<Bucket>& buckets() const { return buckets_; }
  int64_t shard_size() const { return shard_size_; }

  // Collective. shard = this rank's chunk of every bucket of grads (flat), summed over the group.
  void reduce_scatter(const float* grads);
  // The same, overlapped with backward: begin() before the step's last backward, ready(from)
  // whenever the gradients at offsets ≥ from are final (each bucket that is then complete is
  // reduced on `thread`, buckets in their fixed order), finish() after backward (the rest, then
  // waits). The result is the bits reduce_scatter gives. While buckets are in flight only
  // `thread` may call MPI. gather (plain data parallelism): each bucket's reduced chunks are also
  // all-gathered back into `grads` right after its reduce-scatter, so that both halves of the
  // traffic overlap backward; grads then holds what allgather_grads would give.
  void begin(CommThread& thread, float* grads, bool gather);
  void ready(int64_t from);
  void finish();
  // Σ shard² in double, buckets in order (grad_sum_squares per chunk): this rank's part of the
  // global squared norm; the chunks of all ranks cover every gradient element exactly once.
  double shard_sum_squares() const;
  bool shard_has_non_finite() const;
  void scale_shard(float scale);
  bool has_non_finite() const override { return shard_has_non_finite(); }
  double sum_squares() const override { return shard_sum_squares(); }
  // The shard, and the gathered copy when this step's reduced gradients were gathered into the
  // flat buffer (allgather_grads, or begin with gather).
  void scale(float factor) override;
  void range_sums(const std::vector<WeightedRange>& ranges, double* abs_sum,
                  double* sq_sum) const override;
  void scale_ranges(const std::vector<WeightedRange>& ranges) override;
  // grads at every reduced position *= scale (plain DP scales the gathered gradients in place,
  // so that the overlapped and the blocking paths give the same bits).
  void scale_reduced(float* grads, float scale) const;
  // grads at the shard's flat positions = the shard.
  void unpack_shard(float* grads) const;
  // Collective. Every bucket's reduced chunks from every rank of its group → grads (flat).
  void allgather_grads(float* grads);
  // Collective. params at every rank's shard positions → params on every rank of the group.
  void allgather_params(float* params);
  // The same for bucket i alone (over its group); skipped buckets included.
  void allgather_bucket_params(float* params, std::size_t i);
  // The flat ranges of this rank's shard (ZeRO-1 updates exactly these).
  std::vector<ShardPiece> shard_pieces() const;
  // The same elements as runs contiguous both in the flat buffer and in the shard (ZeRO-2's
  // optimizer reads its gradients from the shard): flat offset, position in the shard, length.
  struct ShardSpan {
    int64_t flat = 0, at = 0, size = 0;
  };
  std::vector<ShardSpan> shard_spans() const;
  float* shard_data() { return shard_.data(); }
  // The shard's whole pages go back to the system until the next reduction writes them (it
  // overwrites every element). Returns the bytes released.
  int64_t release_shard();
  // Bucket i's reduced chunk in the shard.
  std::span<float> shard_chunk(std::size_t i) {
    const Bucket& b = buckets_[i];
    return {shard_.data() + b.shard_offset, static_cast<std::size_t>(b.counts[group(b).rank()])};
  }
  // Called with i right after bucket i's reduce-scatter (and gather) completed, on the thread that
  // ran it: its gradients in the flat buffer are read no more (ZeRO-2 releases them there).
  void set_bucket_done(std::function<void(std::size_t)> fn) { bucket_done_ = std::move(fn); }

  // int8 error feedback: per packed element sent (Σ bucket sizes), then per element of the
  // largest shard any rank of the group can hold (Σ ceil(size / P)), so that its length is the
  // same on every rank. sparse_ratio: per packed element of the sparse buckets
  // (SparseBuckets::residual). Empty otherwise. A checkpoint saves it; resume restores it.
  std::vector<float>& residual() { return sparse_.enabled() ? sparse_.residual() : residual_; }
  // sparse_ratio: the sparse buckets' figures (values, entries sent, contributions so far).
  const SparseBuckets& sparse() const { return sparse_; }
  // Sparse experts: buckets whose key is inactive in `active` are skipped by every collective
  // until the next call (their shard chunk reads 0; plain DP leaves their flat gradients as they
  // are, and ZeRO-1 their parameters, which the optimizer leaves alone). Empty: none skipped.
  // Every rank of a group must pass the same mask, before begin() / reduce_scatter().
  void set_active_experts(std::span<const uint8_t> active);
  // Bytes this rank would have sent for the skipped buckets, so far.
  int64_t bytes_skipped() const { return bytes_skipped_; }
  // Bytes of n gradient values on the wire.
  int64_t wire_bytes(int64_t n) const;
  // Bytes bucket i sends in a reduction and its gather (or under ZeRO-1 its reduction alone,
  // which for a sparse bucket is all it sends).
  int64_t bucket_bytes(std::size_t i) const;

  // Bytes this rank has sent to other ranks so far (reductions, gradient and parameter gathers).
  int64_t bytes_sent() const { return bytes_sent_; }

 private:
  Comm& group(const Bucket& b) const { return b.expert ? expert_ : dense_; }
  void pack(float* dst, const float* flat, const Bucket& b, int64_t lo, int64_t hi) const;
  void unpack(float* flat, const float* src, const Bucket& b, int64_t lo, int64_t hi) const;
  void allgather_into(float* flat, const Bucket& b, const float* mine, GradWire wire);
  void reduce_bucket_int8(const Bucket& b, const float* packed, float* out);
  void allgather_int8(float* flat, const Bucket& b, float* mine);
  void gather_bucket(std::size_t i);  // bucket i's reduced chunks → grads_, in wire_
  void reduce_bucket(std::size_t i, const float* grads);
  // fn(flat offset, position in shard_, n) for each contiguous piece of this rank's shard.
  void for_each_shard_piece(const std::function<void(int64_t, int64_t, int64_t)>& fn) const;

  Comm& dense_;
  Comm& expert_;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> lowest_;   // (buckets) lowest flat offset in each
  CommThread* thread_ = nullptr;  // between begin() and finish()
  float* grads_ = nullptr;
  bool gather_ = false;
  float* gathered_ = nullptr;  // the flat buffer holding this step's gathered reduced gradients
  std::size_t next_ = 0;       // first bucket not yet posted
  int64_t shard_size_ = 0;
  std::vector<float> shard_;
  FloatBuffer packed_;
  GradWire wire_ = GradWire::F32;
  std::vector<bf16> wire_send_, wire_recv_;  // bf16 reduction: packed bucket, received parts
  std::vector<uint8_t> q_send_, q_recv_;     // int8 reduction: quantised chunks, received parts
  std::vector<float> residual_;
  std::vector<float> param_send_;  // allgather_bucket_params: this rank's chunk, packed
  int64_t packed_size_ = 0;  // Σ bucket sizes: where the shard part of residual_ starts
  int64_t bytes_sent_ = 0;
  SparseBuckets sparse_;
  std::vector<int> sparse_slot_;  // (buckets) the SparseBuckets slot, -1 for a dense bucket
  std::vector<uint8_t> skip_;  // (buckets) set_active_experts
  std::function<void(std::size_t)> bucket_done_;
  int64_t bytes_skipped_ = 0;
};

}  // namespace moetrain
