#include "train/evaluate.h"

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "data/loader.h"
#include "data/shard.h"
#include "train/pipeline_step.h"

namespace moetrain {

double evaluate(Transformer& model, const float* params, const TokenShard& shard, int64_t B,
                int64_t T, int64_t max_batches, Comm* comm, PipelineRunner* pipe) {
  // A tensor-parallel group's ranks read one batch (and count its loss each: the sums' ratio
  // stays).
  const int tp = static_cast<int>(model.tensor_parallel());
  const int rank = pipe ? static_cast<int>(pipe->replica()) : comm ? comm->rank() / tp : 0;
  const int world = pipe ? static_cast<int>(pipe->replicas()) : comm ? comm->size() / tp : 1;
  const int processes = comm ? comm->size() : 1;
  EvalLoader loader(shard, B, T, max_batches, rank, world);
  std::vector<int32_t> inputs(static_cast<std::size_t>(B * T)), targets(inputs.size());
  double sum = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < loader.num_batches(); ++i) {
    int64_t rows = loader.fill(i, inputs.data(), targets.data());
    // Several processes: every rank runs every batch (the MoE layers are collective), even empty.
    if (rows == 0 && processes == 1) continue;
    std::fill(targets.begin() + rows * T, targets.end(), -1);  // rows past the data count nothing
    MoeStep step;
    step.training = false;
    LossParts parts =
        pipe ? pipe->forward_only(model, params, inputs.data(), targets.data(), B, T, step)
             : model.forward(params, inputs.data(), targets.data(), B, T, step);
    sum += parts.ce * static_cast<double>(parts.targets);
    count += parts.targets;
  }
  if (processes > 1) {
    comm->allreduce(&sum, 1);
    comm->allreduce(&count, 1);
  }
  MOETRAIN_CHECK(count > 0, "validation shard {} has too few tokens for one window of {}",
                 shard.path().string(), T);
  return sum / static_cast<double>(count);
}

}  // namespace moetrain
