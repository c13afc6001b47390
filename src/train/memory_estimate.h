// An up-front estimate of a run's memory, checked against what the machine has before anything
// large is allocated: a config that cannot fit is refused at once with both figures, instead of
// allocating for a while and dying of std::bad_alloc.
#pragma once
#include <cstdint>
#include <string>

#include "model/classifier.h"
#include "model/config.h"

namespace moetrain {

// Bytes per process. Counts the whole model on every process (expert parallelism would hold a
// share of the experts: an upper bound there).
struct MemoryEstimate {
  double parameters = 0;     // fp32 parameters
  double gradients = 0;      // fp32, one per parameter
  double optimizer = 0;      // two fp32 moments per parameter (AdamW)
  double low_precision = 0;  // bf16/fp16 weight copies
  double activations = 0;    // saved for backward: batch × seq × layers × per-token buffers
  double total() const { return parameters + gradients + optimizer + low_precision + activations; }
  std::string breakdown() const;
};

// precision_bytes: 0 for f32, 2 for bf16/fp16 (their weight copies).
MemoryEstimate estimate_memory(const ModelConfig& m, int64_t batch, int64_t seq_len,
                               int precision_bytes);
MemoryEstimate estimate_memory(const ClassifierConfig& m, int64_t batch);
// A loaded model that only runs forward (forward, eval, sample): its parameters and one batch's
// activations; no gradients, moments or copies.
MemoryEstimate estimate_inference_memory(const ModelConfig& m, int64_t batch, int64_t seq_len);

// What this process may use: /proc/meminfo's MemAvailable, or the cgroup's memory.max less its
// usage when lower. `source` says which. < 0 when neither can be read.
double available_memory(std::string* source = nullptr);

// Throws when `processes` processes of this estimate (the ones on this machine) exceed the
// available memory, naming both figures and what the estimate counts. `remedy` says what to make
// smaller (default: the model.* and train.* keys that size a run).
void check_memory(const MemoryEstimate& e, int processes, const std::string& what,
                  const std::string& remedy = {});

}  // namespace moetrain
