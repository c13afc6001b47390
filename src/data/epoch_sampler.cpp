#include "data/epoch_sampler.h"

#include <utility>

#include "core/check.h"
#include "core/rng.h"

namespace moetrain {

EpochSampler::EpochSampler(int64_t n, uint64_t seed) : n_(n), seed_(seed) {
  MOETRAIN_CHECK(n > 0, "EpochSampler: the training set has {} rows, needs at least one", n);
}

std::vector<int64_t> EpochSampler::epoch(int64_t e) const {
  MOETRAIN_CHECK(e >= 0, "EpochSampler: epoch {} is negative", e);
  std::vector<int64_t> perm(static_cast<std::size_t>(n_));
  for (int64_t i = 0; i < n_; ++i) perm[i] = i;
  Rng rng(seed_, rng_stream(RngPurpose::Data, static_cast<uint64_t>(e), 0));
  for (int64_t i = n_ - 1; i > 0; --i) {
    auto j =
        static_cast<int64_t>(rng.below(static_cast<uint64_t>(i), static_cast<uint64_t>(i + 1)));
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

// Positions are read in increasing order, so one cached permutation serves all but the batches
// that straddle two epochs.
const std::vector<int64_t>& EpochSampler::cached_epoch(int64_t e) {
  if (e != cached_epoch_) perm_ = epoch(e), cached_epoch_ = e;
  return perm_;
}

int64_t EpochSampler::at(int64_t position) {
  MOETRAIN_CHECK(position >= 0, "EpochSampler: position {} is negative", position);
  return cached_epoch(position / n_)[static_cast<std::size_t>(position % n_)];
}

void EpochSampler::batch(int64_t step, int64_t B, int64_t* rows) {
  MOETRAIN_CHECK(step >= 0 && B >= 0, "EpochSampler::batch: step {} and batch {} must be ≥ 0", step,
                 B);
  for (int64_t b = 0; b < B; ++b) rows[b] = at(step * B + b);
}

}  // namespace moetrain
