// Data-parallel gradient reduction over the flat gradient buffer, in buckets. Every bucket is
// reduced as reduce-scatter then all-gather (Comm sums in rank order), so plain data parallelism
// and ZeRO-1 share one summation path and give the same bits:
//   plain DP: reduce_scatter → allgather_grads → (norm on the shard; unscale, clip in place
//             with scale_reduced) → full optimizer step
//   ZeRO-1:   reduce_scatter → (norm, clip on the shard) → unpack_shard → step on the shard only
//             → allgather_params
// Replicated parameters reduce over every rank (`dense` communicator); this rank's experts over
// its expert-data-parallel group (`expert`). Buckets are cut walking the buffer from its end,
// the order backward produces gradients in: the first bucket of each kind is small (1 MiB by
// default) so reduction can start early, the rest larger (25 MiB). A bucket holds pieces of one
// kind only and its P chunks are [n·q/P, n·(q+1)/P) of its packed elements; chunk q is rank q's
// shard. Every rank of a group cuts the same buckets, in the same order.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/buffer.h"
#include "core/comm.h"
#include "core/dtype.h"
#include "model/params.h"
#include "optim/update.h"
#include "parallel/comm_thread.h"
#include "parallel/groups.h"

namespace moetrain {

struct GradSyncConfig {
  int64_t first_bucket_bytes = int64_t{1} << 20;
  int64_t bucket_bytes = int64_t{25} << 20;
  // Element type on the wire for the gradient reduce-scatter and all-gather: F32 or BF16. In
  // bf16 every rank's gradients are rounded to bf16 before they are sent (its own chunk too, so
  // the sum is symmetric in the ranks), summed in f32 in rank order, and the reduced chunks are
  // all-gathered as bf16 again (each rank's own chunk included, so every rank holds the same
  // bits). Half the bytes; bucket sizes stay in f32 bytes. Parameters (ZeRO-1) travel in f32.
  DType reduce_dtype = DType::F32;
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
  // The flat ranges of this rank's shard (ZeRO-1 updates exactly these).
  std::vector<ShardPiece> shard_pieces() const;

  double seconds() const { return seconds_; }  // spent in the collective calls so far
  // Bytes this rank has sent to other ranks so far (reductions, gradient and parameter gathers).
  int64_t bytes_sent() const { return bytes_sent_; }

 private:
  Comm& group(const Bucket& b) const { return b.expert ? expert_ : dense_; }
  void pack(float* dst, const float* flat, const Bucket& b, int64_t lo, int64_t hi) const;
  void unpack(float* flat, const float* src, const Bucket& b, int64_t lo, int64_t hi) const;
  void allgather_into(float* flat, const Bucket& b, const float* mine, DType wire);
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
  DType wire_ = DType::F32;
  std::vector<bf16> wire_send_, wire_recv_;  // bf16 reduction: packed bucket, received parts
  double seconds_ = 0;
  int64_t bytes_sent_ = 0;
};

}  // namespace moetrain
