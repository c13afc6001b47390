// Validation of the language model.
#pragma once
#include <cstdint>

#include "core/comm.h"
#include "model/transformer.h"

namespace moetrain {

class TokenShard;
class PipelineRunner;

// What the language model's loss is measured in: its tokens are bytes (data/tokenizer.h).
inline constexpr const char* kLmLossUnit = "nats/byte";

// Validation loss (mean next-token cross-entropy, nats per token) over up to `max_batches`
// batches of (B, T) windows of the shard. With a communicator of several processes (collective:
// every rank calls it), each rank takes its B windows of every global batch and the result is the
// loss over all of them, the same on every rank.
// With a pipeline (dist.pp > 1; comm is then every process), each batch goes through the stages
// and the pipeline's copy takes the windows a data-parallel rank would.
double evaluate(Transformer& model, const float* params, const TokenShard& shard, int64_t B,
                int64_t T, int64_t max_batches, Comm* comm = nullptr,
                PipelineRunner* pipe = nullptr);

}  // namespace moetrain
