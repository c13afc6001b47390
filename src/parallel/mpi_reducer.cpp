#include "parallel/mpi_reducer.h"

#include <utility>

#include "core/timer.h"

namespace moetrain {

MpiGradReducer::MpiGradReducer(std::unique_ptr<GradSync> sync, CommThread* overlap, bool zero1)
    : sync_(std::move(sync)), overlap_(overlap), zero1_(zero1) {}

void MpiGradReducer::begin(float* grads) {
  // Plain DP gathers each bucket right after its reduce-scatter, so both halves overlap backward.
  if (overlap_) sync_->begin(*overlap_, grads, /*gather=*/!zero1_);
}

GradientShard& MpiGradReducer::reduce(float* grads) {
  // Plain DP: the reduced gradients are gathered into grads before any scaling, and the unscale
  // and clip multiply them in place (GradSync::scale): the same bits with or without overlap,
  // whatever the wire type. ZeRO-1 scales the shard it updates.
  if (overlap_) {
    sync_->finish();
  } else {
    ScopedTimer timer(inline_s_);
    sync_->reduce_scatter(grads);
    if (!zero1_) sync_->allgather_grads(grads);
  }
  return *sync_;
}

void MpiGradReducer::prepare_step(float* grads) {
  if (zero1_) sync_->unpack_shard(grads);
}

void MpiGradReducer::finish_step(float* params) {
  if (!zero1_) return;
  ScopedTimer timer(inline_s_);
  sync_->allgather_params(params);
}

}  // namespace moetrain
