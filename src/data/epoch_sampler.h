// Epochs of a data set of n items: each a permutation of [0, n) drawn from (seed, epoch) alone,
// laid end to end into one stream of positions. The classifier's rows and the language model's
// windows (data/loader.h) are both read in this order.
#pragma once
#include <cstdint>
#include <vector>

namespace moetrain {

// Epoch e is a permutation of [0, n) drawn from (seed, e) alone (Fisher-Yates on counter-based
// numbers, RngPurpose::Data with the epoch as the stream's step). Position p of the stream is item
// epoch(p / n)[p mod n]: every n consecutive positions starting at a multiple of n visit every item
// exactly once. A pure function of (n, seed, p); one epoch's permutation (8 bytes an item) is kept,
// so reading positions in increasing order computes each epoch once.
class EpochSampler {
 public:
  EpochSampler(int64_t n, uint64_t seed);
  int64_t size() const { return n_; }
  // The item at stream position `position` (≥ 0).
  int64_t at(int64_t position);
  // rows (B) = the items at positions step·B … step·B+B−1: a batch may straddle two epochs.
  void batch(int64_t step, int64_t B, int64_t* rows);
  // The permutation of epoch `e` (n).
  std::vector<int64_t> epoch(int64_t e) const;

 private:
  const std::vector<int64_t>& cached_epoch(int64_t e);

  int64_t n_;
  uint64_t seed_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> perm_;
};

}  // namespace moetrain
