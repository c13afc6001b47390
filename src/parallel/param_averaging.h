// Local SGD (dist.sync = "params"): every data-parallel replica steps on its own gradients and,
// every dist.sync_every steps, the replicas' parameters (and, with dist.sync_moments, their
// optimizer moments) are replaced by their mean. The groups are GradSync's: replicated parameters
// are averaged over every rank (`dense`), this rank's experts over their expert-data-parallel
// group (`expert`). Each mean is an all-reduce in f32 (Comm sums in rank order, identical bits on
// every rank) times 1/P.
#pragma once
#include <cstdint>
#include <vector>

#include "core/comm.h"
#include "parallel/grad_sync.h"
#include "optim/sharded_optimizer.h"

namespace moetrain {

class ParamAverager {
 public:
  // dense, expert: communicators that must outlive this object.
  ParamAverager(const SyncRanges& ranges, Comm& dense, Comm& expert);

  // Collective. params at every range this rank reduces = the mean over its group. Returns how
  // far this rank's parameters were from the mean: max |p − mean| over them.
  double average_params(float* params);
  // Collective. The optimizer's state, piece by piece (its pieces are the ranges: no ZeRO-1).
  void average_moments(ShardedOptimizer& optimizer);

  int64_t bytes_sent() const { return bytes_sent_; }
  double seconds() const { return seconds_; }

 private:
  // The ranges of one kind packed, averaged over comm, unpacked.
  double average(const std::vector<std::pair<float*, int64_t>>& parts, Comm& comm);

  SyncRanges ranges_;
  Comm& dense_;
  Comm& expert_;
  std::vector<float> packed_;
  int64_t bytes_sent_ = 0;
  double seconds_ = 0;
};

}  // namespace moetrain
