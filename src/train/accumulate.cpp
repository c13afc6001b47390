#include "train/accumulate.h"

#include <algorithm>

namespace moetrain {

MicroLoss forward_micro(Transformer& model, const float* params, const TokenBatch& batch,
                        const MoeStep& step) {
  return {model.forward(params, batch.inputs, batch.targets, batch.B, batch.T, step), 0};
}

MicroLoss forward_micro(Classifier& model, const float* params, const ImageBatch& batch,
                        const MoeStep& step) {
  const ClassifierLoss l = model.forward(params, batch.inputs, batch.labels, batch.N, step);
  return {{l.ce, l.aux, l.z, l.total, l.n}, l.correct};
}

MoeStep micro_batch_step(uint64_t seed, int64_t step, int64_t micro_batches, int64_t micro,
                         int64_t token_offset) {
  MoeStep ms;
  ms.training = true;
  ms.seed = seed;
  ms.step = static_cast<uint64_t>(step * micro_batches + micro);
  ms.token_offset = static_cast<uint64_t>(token_offset);
  return ms;
}

void update_router_biases(const std::vector<MoeLayer*>& moe, int64_t E, Comm& comm) {
  if (moe.empty()) return;
  std::vector<int64_t> global(moe.size() * E);
  for (std::size_t m = 0; m < moe.size(); ++m)
    std::copy_n(moe[m]->pending_load(), E, global.begin() + m * E);
  comm.allreduce(global.data(), static_cast<int64_t>(global.size()));
  for (std::size_t m = 0; m < moe.size(); ++m) moe[m]->apply_bias_update(global.data() + m * E);
}

namespace detail {

void accumulate_stats(const std::vector<MoeLayer*>& moe, double dropped_divisor, Accumulated& acc) {
  for (std::size_t m = 0; m < moe.size(); ++m) {
    if (!moe[m]) continue;  // a layer that did not run here (another pipeline stage's)
    const MoeStats& s = moe[m]->stats();
    std::vector<int64_t>& load = acc.tokens_per_expert[m];
    for (std::size_t e = 0; e < load.size(); ++e) load[e] += s.tokens_per_expert[e];
    acc.dropped[m] += s.fraction_dropped / dropped_divisor;
    const int64_t computed = s.assignments - s.dropped;
    acc.computed[m] += computed;
    acc.capacity_slots[m] +=
        s.capacity > 0 ? static_cast<int64_t>(load.size()) * s.capacity : computed;
    acc.capacity_factor[m] = s.capacity_factor;
    acc.a2a_s += moe[m]->timings().a2a;
    acc.a2a_wait_s += moe[m]->timings().a2a_wait;
    acc.a2a_bytes += moe[m]->timings().a2a_bytes;
  }
}

}  // namespace detail
}  // namespace moetrain
