#include "parallel/grad_sync.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/check.h"
#include "core/page_buffer.h"
#include "core/profile.h"
#include "optim/clip.h"
#include "core/block_quant.h"

namespace moetrain {

namespace {

// fn(r, a, z) for each range r of `ranges` (sorted by offset, disjoint) that overlaps [lo, hi),
// [a, z) being the overlap.
template <class Fn>
void overlaps(const std::vector<WeightedRange>& ranges, int64_t lo, int64_t hi, Fn&& fn) {
  auto it =
      std::upper_bound(ranges.begin(), ranges.end(), lo,
                       [](int64_t x, const WeightedRange& r) { return x < r.offset + r.size; });
  for (; it != ranges.end() && it->offset < hi; ++it) {
    const int64_t a = std::max(lo, it->offset), z = std::min(hi, it->offset + it->size);
    if (a < z) fn(static_cast<std::size_t>(it - ranges.begin()), a, z);
  }
}

}  // namespace

GradSync::GradSync(const SyncRanges& ranges, Comm& dense, Comm& expert, const GradSyncConfig& cfg)
    : dense_(dense), expert_(expert), wire_(cfg.wire), sparse_(cfg.sparse_ratio, cfg.wire) {
  MOETRAIN_CHECK(cfg.sparse_ratio == 0 || (cfg.sparse_ratio > 0 && cfg.sparse_ratio <= 1 &&
                                           cfg.wire != GradWire::Int8),
                 "sparse gradient ratio {} with a {} wire: must be in (0, 1] with f32 or bf16",
                 cfg.sparse_ratio, grad_wire_name(cfg.wire));
  MOETRAIN_CHECK(cfg.first_bucket_bytes >= 4 && cfg.bucket_bytes >= 4,
                 "gradient buckets of {} and {} bytes: each must hold at least one float",
                 cfg.first_bucket_bytes, cfg.bucket_bytes);
  struct Run {
    FlatRange range;
    bool expert;
    int64_t key = -1;
  };
  std::vector<Run> runs;
  for (const FlatRange& r : ranges.dense) runs.push_back({r, false});
  if (cfg.sparse_experts) {
    for (const ExpertPiece& p : ranges.expert_keyed)
      runs.push_back({{p.offset, p.size}, true, p.key});
  } else {
    for (const FlatRange& r : ranges.expert) runs.push_back({r, true});
  }
  std::sort(runs.begin(), runs.end(),
            [](const Run& a, const Run& b) { return a.range.offset > b.range.offset; });

  Bucket open[2];
  bool first[2] = {true, true};
  auto cap = [&](int k) {
    return std::max<int64_t>(1, (first[k] ? cfg.first_bucket_bytes : cfg.bucket_bytes) / 4);
  };
  auto close = [&](int k) {
    Bucket& b = open[k];
    if (b.size == 0) return;
    b.expert = k == 1;
    Comm& comm = group(b);
    const int P = comm.size(), q = comm.rank();
    b.counts.resize(P);
    for (int p = 0; p < P; ++p)
      b.counts[p] = chunk_begin(b.size, p + 1, P) - chunk_begin(b.size, p, P);
    b.chunk_begin = chunk_begin(b.size, q, P);
    b.shard_offset = shard_size_;
    b.packed_offset = packed_size_;
    shard_size_ += b.counts[q];
    packed_size_ += b.size;
    buckets_.push_back(std::move(b));
    const int64_t key = b.key;
    open[k] = Bucket{};
    open[k].key = key;
    first[k] = false;
  };
  // The unit holding flat offset x, and where it begins (units: one unit from 0 when none).
  const std::vector<int64_t>& starts = cfg.unit_starts;
  auto unit_of = [&](int64_t x) {
    return static_cast<int64_t>(std::upper_bound(starts.begin(), starts.end(), x) -
                                starts.begin()) - 1;
  };
  int64_t open_unit[2] = {-1, -1};
  // From the end of the buffer down: the order in which backward finishes gradients.
  for (const Run& run : runs) {
    const int k = run.expert ? 1 : 0;
    // One expert per bucket when sparse, so that a bucket is skipped or sent as a whole.
    if (run.expert && open[1].size > 0 && open[1].key != run.key) close(1);
    open[k].key = run.key;
    int64_t end = run.range.offset + run.range.size;
    while (end > run.range.offset) {
      const int64_t u = unit_of(end - 1);
      if (open[k].size > 0 && open_unit[k] != u) close(k);
      open_unit[k] = u;
      const int64_t floor = u >= 0 ? std::max(run.range.offset, starts[u]) : run.range.offset;
      const int64_t take = std::min(end - floor, cap(k) - open[k].size);
      open[k].pieces.push_back({end - take, take});
      open[k].size += take;
      end -= take;
      if (open[k].size == cap(k)) close(k);
    }
  }
  close(0);
  close(1);
  shard_.assign(static_cast<std::size_t>(shard_size_), 0.0f);
  if (wire_ == GradWire::Int8) {
    int64_t largest_shard = 0;
    for (const Bucket& b : buckets_) {
      const int64_t P = group(b).size();
      largest_shard += (b.size + P - 1) / P;
    }
    residual_.assign(static_cast<std::size_t>(packed_size_ + largest_shard), 0.0f);
  }
  skip_.assign(buckets_.size(), 0);
  // A group of one sends nothing: selecting would only delay its gradients.
  for (const Bucket& b : buckets_)
    sparse_slot_.push_back(cfg.sparse_ratio > 0 && b.expert && group(b).size() > 1
                               ? sparse_.add_bucket(b.size)
                               : -1);
  for (const Bucket& b : buckets_) {
    int64_t low = INT64_MAX;
    for (const FlatRange& p : b.pieces) low = std::min(low, p.offset);
    lowest_.push_back(low);
  }
}

void GradSync::pack(float* dst, const float* flat, const Bucket& b, int64_t lo, int64_t hi) const {
  int64_t pos = 0;
  for (const FlatRange& p : b.pieces) {
    const int64_t a = std::max(lo, pos), z = std::min(hi, pos + p.size);
    if (a < z)
      std::memcpy(dst + (a - lo), flat + p.offset + (a - pos),
                  static_cast<std::size_t>(z - a) * sizeof(float));
    pos += p.size;
  }
}

void GradSync::unpack(float* flat, const float* src, const Bucket& b, int64_t lo,
                      int64_t hi) const {
  int64_t pos = 0;
  for (const FlatRange& p : b.pieces) {
    const int64_t a = std::max(lo, pos), z = std::min(hi, pos + p.size);
    if (a < z)
      std::memcpy(flat + p.offset + (a - pos), src + (a - lo),
                  static_cast<std::size_t>(z - a) * sizeof(float));
    pos += p.size;
  }
}

void GradSync::set_active_experts(std::span<const uint8_t> active) {
  MOETRAIN_CHECK(thread_ == nullptr,
                 "GradSync::set_active_experts while an overlapped reduction is in flight");
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    const int64_t key = buckets_[i].key;
    MOETRAIN_CHECK(key < 0 || active.empty() || key < static_cast<int64_t>(active.size()),
                   "gradient bucket of expert key {} outside the mask of {}", key, active.size());
    skip_[i] = key >= 0 && !active.empty() && !active[key];
  }
}

int64_t GradSync::wire_bytes(int64_t n) const {
  switch (wire_) {
    case GradWire::F32: return 4 * n;
    case GradWire::BF16: return 2 * n;
    case GradWire::Int8: return quant_wire_bytes(n);
  }
  return 4 * n;
}

int64_t GradSync::bucket_bytes(std::size_t i) const {
  const Bucket& b = buckets_[i];
  const int P = group(b).size();
  if (sparse_slot_[i] >= 0) return sparse_.bytes_sent(sparse_slot_[i], P);
  const int64_t mine = b.counts[group(b).rank()];
  return wire_bytes(b.size - mine) + wire_bytes(mine) * (P - 1);
}

void GradSync::reduce_bucket(std::size_t i, const float* grads) {
  const Bucket& b = buckets_[i];
  Comm& comm = group(b);
  const int P = comm.size(), me = comm.rank();
  const int64_t mine = b.counts[me];
  if (skip_[i]) {
    // What the reduce-scatter and the gradient all-gather would have sent.
    bytes_skipped_ += bucket_bytes(i);
    std::fill_n(shard_.data() + b.shard_offset, mine, 0.0f);
    return;
  }
  float* packed = packed_.ensure(b.size);
  pack(packed, grads, b, 0, b.size);
  float* out = shard_.data() + b.shard_offset;
  if (sparse_slot_[i] >= 0) {
    // The whole reduced bucket lands in packed; this rank's chunk of it is the shard's.
    bytes_sent_ += sparse_.reduce(sparse_slot_[i], comm, packed, packed);
    std::memcpy(out, packed + b.chunk_begin, static_cast<std::size_t>(mine) * sizeof(float));
    return;
  }
  // A group of one sends nothing: int8 would only add its error.
  if (wire_ == GradWire::Int8 && P > 1) {
    reduce_bucket_int8(b, packed, out);
    return;
  }
  bytes_sent_ += (b.size - mine) * (wire_ == GradWire::BF16 ? 2 : 4);
  if (wire_ != GradWire::BF16) {
    comm.reduce_scatter(out, packed, b.counts);
    return;
  }
  // bf16 on the wire: chunk q of the rounded bucket to rank q; rank q's P parts summed in f32 in
  // rank order, as Comm::reduce_scatter does for f32.
  wire_send_.resize(static_cast<std::size_t>(b.size));
  f32_to_bf16(wire_send_.data(), packed, static_cast<std::size_t>(b.size));
  wire_recv_.resize(static_cast<std::size_t>(P * mine));
  constexpr int64_t kBytes = 2;
  std::vector<int64_t> send_counts(P), send_displs(P), recv_counts(P), recv_displs(P);
  for (int q = 0; q < P; ++q) {
    send_counts[q] = b.counts[q] * kBytes;
    send_displs[q] = chunk_begin(b.size, q, P) * kBytes;
    recv_counts[q] = mine * kBytes;
    recv_displs[q] = q * mine * kBytes;
  }
  comm.alltoallv(wire_recv_.data(), recv_counts, recv_displs, wire_send_.data(), send_counts,
                 send_displs);
  const bf16* parts = wire_recv_.data();
  for (int64_t e = 0; e < mine; ++e) out[e] = parts[e].to_float();
  for (int q = 1; q < P; ++q) {
    const bf16* src = parts + q * mine;
    for (int64_t e = 0; e < mine; ++e) out[e] += src[e].to_float();
  }
}

void GradSync::reduce_bucket_int8(const Bucket& b, const float* packed, float* out) {
  // Chunk q quantised (with this rank's residual at its packed positions) to rank q, its own
  // chunk included so that the sum is symmetric in the ranks; each part is dequantised and
  // added in f32 in rank order.
  Comm& comm = group(b);
  const int P = comm.size(), me = comm.rank();
  const int64_t mine = b.counts[me];
  std::vector<int64_t> send_counts(P), send_displs(P), recv_counts(P), recv_displs(P);
  int64_t send_total = 0;
  for (int q = 0; q < P; ++q) {
    send_counts[q] = quant_wire_bytes(b.counts[q]);
    send_displs[q] = send_total;
    send_total += send_counts[q];
    recv_counts[q] = quant_wire_bytes(mine);
    recv_displs[q] = q * recv_counts[q];
    if (q != me) bytes_sent_ += send_counts[q];
  }
  q_send_.resize(static_cast<std::size_t>(send_total));
  q_recv_.resize(static_cast<std::size_t>(P * recv_counts[0]));
  float* residual = residual_.data() + b.packed_offset;
  for (int q = 0; q < P; ++q) {
    const int64_t at = chunk_begin(b.size, q, P);
    quantise_int8_feedback(q_send_.data() + send_displs[q], packed + at, residual + at,
                           b.counts[q]);
  }
  comm.alltoallv(q_recv_.data(), recv_counts, recv_displs, q_send_.data(), send_counts,
                 send_displs);
  dequantise_int8(out, q_recv_.data(), mine);
  for (int q = 1; q < P; ++q) accumulate_int8(out, q_recv_.data() + recv_displs[q], mine);
}

void GradSync::allgather_int8(float* flat, const Bucket& b, float* mine) {
  // The reduced chunk quantised with the shard's own residual; this rank keeps what the others
  // will decode, so the shard (norm, clip) and every rank's gathered copy are the same bits.
  Comm& comm = group(b);
  const int P = comm.size(), me = comm.rank();
  const int64_t n = b.counts[me];
  std::vector<int64_t> bytes(P), displs(P);
  int64_t total = 0;
  for (int q = 0; q < P; ++q) {
    bytes[q] = quant_wire_bytes(b.counts[q]);
    displs[q] = total;
    total += bytes[q];
  }
  bytes_sent_ += bytes[me] * (P - 1);
  q_send_.resize(static_cast<std::size_t>(bytes[me]));
  quantise_int8_feedback(q_send_.data(), mine, residual_.data() + packed_size_ + b.shard_offset,
                         n);
  q_recv_.resize(static_cast<std::size_t>(total));
  comm.allgatherv(q_recv_.data(), bytes, displs, q_send_.data());
  float* packed = packed_.ensure(b.size);
  for (int q = 0; q < P; ++q)
    dequantise_int8(packed + chunk_begin(b.size, q, P), q_recv_.data() + displs[q], b.counts[q]);
  std::memcpy(mine, packed + b.chunk_begin, static_cast<std::size_t>(n) * sizeof(float));
  unpack(flat, packed, b, 0, b.size);
}

void GradSync::reduce_scatter(const float* grads) {
  MOETRAIN_CHECK(thread_ == nullptr,
                 "GradSync::reduce_scatter while an overlapped reduction is in flight");
  PhaseScope phase_scope(Phase::GradReduce);
  gathered_ = nullptr;
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    reduce_bucket(i, grads);
    if (bucket_done_) bucket_done_(i);
  }
}

void GradSync::begin(CommThread& thread, float* grads, bool gather) {
  MOETRAIN_CHECK(thread_ == nullptr, "GradSync::begin: the previous reduction was not finished");
  thread_ = &thread;
  grads_ = grads;
  gather_ = gather;
  gathered_ = nullptr;
  next_ = 0;
}

void GradSync::ready(int64_t from) {
  if (thread_ == nullptr) return;
  // In bucket order only, so every rank posts the same collectives in the same order.
  for (; next_ < buckets_.size() && lowest_[next_] >= from; ++next_) {
    const std::size_t i = next_;
    thread_->post([this, i] {
      reduce_bucket(i, grads_);
      // The bucket's gradients are final (backward only writes lower offsets now), so its
      // reduced values can land in place while backward goes on.
      if (gather_ && !skip_[i]) gather_bucket(i);
      if (bucket_done_) bucket_done_(i);
    });
  }
}

void GradSync::finish() {
  MOETRAIN_CHECK(thread_ != nullptr, "GradSync::finish without begin");
  ready(INT64_MIN);
  CommThread* thread = thread_;
  thread_ = nullptr;
  PhaseScope phase_scope(Phase::GradReduce);
  thread->drain();
  if (gather_) gathered_ = grads_;
}

double GradSync::shard_sum_squares() const {
  double sum = 0.0;
  for (const Bucket& b : buckets_)
    sum += grad_sum_squares(shard_.data() + b.shard_offset, b.counts[group(b).rank()]);
  return sum;
}

bool GradSync::shard_has_non_finite() const {
  return moetrain::has_non_finite(shard_.data(), shard_size_);
}

void GradSync::scale_shard(float scale) {
  scale_gradients(shard_.data(), shard_size_, scale);
}

void GradSync::scale(float factor) {
  scale_shard(factor);
  if (gathered_) scale_reduced(gathered_, factor);
}

void GradSync::for_each_shard_piece(
    const std::function<void(int64_t, int64_t, int64_t)>& fn) const {
  for (const Bucket& b : buckets_) {
    const int64_t lo = b.chunk_begin, hi = lo + b.counts[group(b).rank()];
    int64_t pos = 0;
    for (const FlatRange& p : b.pieces) {
      const int64_t a = std::max(lo, pos), z = std::min(hi, pos + p.size);
      if (a < z) fn(p.offset + (a - pos), b.shard_offset + (a - lo), z - a);
      pos += p.size;
    }
  }
}

void GradSync::range_sums(const std::vector<WeightedRange>& ranges, double* abs_sum,
                          double* sq_sum) const {
  for_each_shard_piece([&](int64_t flat, int64_t at, int64_t n) {
    overlaps(ranges, flat, flat + n, [&](std::size_t r, int64_t a, int64_t z) {
      add_range_sums(shard_.data() + at + (a - flat), z - a, abs_sum[r], sq_sum[r]);
    });
  });
}

void GradSync::scale_ranges(const std::vector<WeightedRange>& ranges) {
  for_each_shard_piece([&](int64_t flat, int64_t at, int64_t n) {
    overlaps(ranges, flat, flat + n, [&](std::size_t r, int64_t a, int64_t z) {
      scale_gradients(shard_.data() + at + (a - flat), z - a, ranges[r].factor);
    });
  });
  if (!gathered_) return;
  for (const Bucket& b : buckets_)
    for (const FlatRange& p : b.pieces)
      overlaps(ranges, p.offset, p.offset + p.size, [&](std::size_t r, int64_t a, int64_t z) {
        scale_gradients(gathered_ + a, z - a, ranges[r].factor);
      });
}

void GradSync::scale_reduced(float* grads, float scale) const {
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    if (skip_[i]) continue;
    for (const FlatRange& p : buckets_[i].pieces) scale_gradients(grads + p.offset, p.size, scale);
  }
}

void GradSync::unpack_shard(float* grads) const {
  for (const Bucket& b : buckets_) {
    const int64_t n = b.counts[group(b).rank()];
    unpack(grads, shard_.data() + b.shard_offset, b, b.chunk_begin, b.chunk_begin + n);
  }
}

void GradSync::gather_bucket(std::size_t i) {
  const Bucket& b = buckets_[i];
  float* mine = shard_.data() + b.shard_offset;
  if (sparse_slot_[i] >= 0) {
    // Every rank already received every list: the same sum again, nothing sent.
    float* packed = packed_.ensure(b.size);
    sparse_.resum(sparse_slot_[i], packed);
    unpack(grads_, packed, b, 0, b.size);
    return;
  }
  if (wire_ == GradWire::Int8) {
    if (group(b).size() > 1) {
      allgather_int8(grads_, b, mine);
    } else {
      allgather_into(grads_, b, mine, GradWire::F32);
    }
  } else {
    allgather_into(grads_, b, mine, wire_);
  }
}

void GradSync::allgather_into(float* flat, const Bucket& b, const float* mine, GradWire wire) {
  Comm& comm = group(b);
  const int64_t n = b.counts[comm.rank()];
  bytes_sent_ += n * (comm.size() - 1) * (wire == GradWire::F32 ? 4 : 2);
  float* packed = packed_.ensure(b.size);
  if (wire == GradWire::F32) {
    comm.allgather(packed, mine, b.counts);
  } else {
    wire_send_.resize(static_cast<std::size_t>(n));
    f32_to_bf16(wire_send_.data(), mine, static_cast<std::size_t>(n));
    wire_recv_.resize(static_cast<std::size_t>(b.size));
    comm.allgather(wire_recv_.data(), wire_send_.data(), b.counts);
    bf16_to_f32(packed, wire_recv_.data(), static_cast<std::size_t>(b.size));
  }
  unpack(flat, packed, b, 0, b.size);
}

void GradSync::allgather_grads(float* grads) {
  PhaseScope phase_scope(Phase::GradReduce);
  gathered_ = grads;
  grads_ = grads;
  for (std::size_t i = 0; i < buckets_.size(); ++i)
    if (!skip_[i]) gather_bucket(i);
}

int64_t GradSync::release_shard() {
  return release_whole_pages(shard_.data(), shard_size_ * static_cast<int64_t>(sizeof(float)));
}

void GradSync::allgather_params(float* params) {
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    // Every rank left the skipped expert's parameters as they were.
    if (!skip_[i]) allgather_bucket_params(params, i);
  }
}

void GradSync::allgather_bucket_params(float* params, std::size_t i) {
  const Bucket& b = buckets_[i];
  const int64_t n = b.counts[group(b).rank()];
  param_send_.resize(static_cast<std::size_t>(n));
  pack(param_send_.data(), params, b, b.chunk_begin, b.chunk_begin + n);
  allgather_into(params, b, param_send_.data(), GradWire::F32);  // master weights stay f32
}

}  // namespace moetrain
