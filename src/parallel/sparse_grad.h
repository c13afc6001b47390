// Value-level sparse gradient reduction (grad.sparse_ratio): of each expert bucket's n packed
// gradient values a rank sends only the k = ceil(ratio·n) largest in magnitude, as (index, value)
// pairs, and keeps the rest in an error-feedback residual that is added to the next step's values
// at the same positions, so nothing is lost, only delayed.
//
// Selection (select_top_k): v = gradient + residual; the k entries of largest |v| (a NaN counts
// as largest, so an overflow is sent and seen by the checks after the reduction), ties broken by
// the lower position, listed by increasing position. The residual becomes v at every position not
// sent and, at a sent one, what rounding the value to the wire type lost (0 in f32), so that
// sent + residual = v exactly.
//
// Wire (one list per rank): k int32 positions, then k values (f32, or bf16 with
// dist.grad_reduce_dtype = bf16): sparse_list_bytes(k, wire) bytes. Every rank of the group sends
// the same k, so one all-gather of fixed-size lists moves them; each rank sends its list to the
// P − 1 others.
//
// Sum (accumulate_lists): the P lists in rank order into a dense bucket, with a count per entry
// of the ranks that sent it: the first contributor's value is copied, later ones added, entries
// nobody sent read 0. In rank order, so every rank holds the same bits whatever its thread count;
// at ratio 1 (every entry sent by every rank) the bits are those of the dense reduce-scatter,
// which copies rank 0's part and adds the others in rank order. The counts are not divisors: each
// rank's gradient is already its share of the mean (loss weight 1/(A·W)), and a part a rank did
// not send is in its residual, to be sent later; dividing an entry by its contributors would
// count that part twice over time. They serve the copy-or-add above and the figures (how many
// entries the group reduced, how many ranks agreed on each).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/comm.h"
#include "parallel/grad_wire.h"

namespace moetrain {

// k = ceil(ratio·n), at least 1 for a non-empty bucket, at most n.
int64_t sparse_keep(int64_t n, double ratio);

// Bytes of one rank's list of k entries: 4-byte positions and f32 (4) or bf16 (2) values.
int64_t sparse_list_bytes(int64_t k, GradWire wire);

// g (n), residual (n, updated), k ≤ n: writes the list (sparse_list_bytes(k, wire) bytes) of the
// top-k of g + residual into `list`. scratch is reused between calls.
void select_top_k(const float* g, float* residual, int64_t n, int64_t k, GradWire wire,
                  uint8_t* list, std::vector<uint64_t>& scratch);

// The lists of P ranks, one after another (P · sparse_list_bytes(k, wire) bytes), summed into
// out (n) in rank order; counts (n) = the ranks that sent each entry.
void accumulate_lists(float* out, int32_t* counts, int64_t n, const uint8_t* lists, int P,
                      int64_t k, GradWire wire);

// The sparse buckets of a GradSync (its expert buckets reduced over a group of more than one
// rank): their residual, the lists each received at its last reduction (the gather of plain data
// parallelism sums them again into the flat buffer, so that the shard and the gathered copy are
// the same bits), and the figures.
class SparseBuckets {
 public:
  SparseBuckets(double ratio, GradWire wire) : ratio_(ratio), wire_(wire) {}
  bool enabled() const { return ratio_ > 0; }
  // A bucket of n packed values; returns its slot.
  int add_bucket(int64_t n);
  int64_t keep(int slot) const { return sparse_keep(slots_[slot].n, ratio_); }
  // Bytes one reduction of the slot's bucket sends: its list to each of the P − 1 others.
  int64_t bytes_sent(int slot, int P) const { return sparse_list_bytes(keep(slot), wire_) * (P - 1); }
  // Collective over comm: packed (the bucket's n values) → sum (n), the group's sum of its ranks'
  // lists; the lists are kept for resum. Returns the bytes sent.
  int64_t reduce(int slot, Comm& comm, const float* packed, float* sum);
  // sum (n) = what the slot's last reduce gave, from its kept lists.
  void resum(int slot, float* sum);

  // Error feedback, per packed value of every sparse bucket in slot order (the same length on
  // every rank of a group). A checkpoint saves it; resume restores it.
  std::vector<float>& residual() { return residual_; }
  // So far: values reduced (Σ n), entries some rank sent (count > 0), contributions (Σ counts).
  int64_t values() const { return values_; }
  int64_t entries_sent() const { return entries_; }
  int64_t contributions() const { return contributions_; }
  int64_t bytes() const { return bytes_; }  // sent by the sparse buckets

 private:
  struct Slot {
    int64_t n = 0, at = 0;  // values; where its residual starts
    std::vector<uint8_t> recv;  // (P lists) the last reduction's
  };
  double ratio_;
  GradWire wire_;
  std::vector<Slot> slots_;
  std::vector<float> residual_;
  std::vector<uint8_t> send_;
  std::vector<uint64_t> scratch_;
  std::vector<int32_t> counts_;
  int64_t values_ = 0, entries_ = 0, contributions_ = 0, bytes_ = 0;
};

}  // namespace moetrain
