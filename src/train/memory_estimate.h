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
  double parameters = 0;     // the weights as stored (fp32 here)
  double gradients = 0;      // fp32, one per parameter
  double optimizer = 0;      // fp32 optimizer state (AdamW: two moments) and master weights
  double low_precision = 0;  // bf16/fp16 weight copies
  double activations = 0;    // saved for backward: batch × seq × layers × per-token buffers
  double total() const { return parameters + gradients + optimizer + low_precision + activations; }
  std::string breakdown() const;
};

// How a process keeps each parameter's state: bytes per parameter of each kind, and which of
// them ZeRO shards over the ranks that hold copies of the parameter (stage 1: the optimizer
// state, f32 master weights included; 2: also the gradients; 3: also the weights and their
// copies). The one formula of state memory: the trainer's start-up estimate and the planner
// (plan/memory_model.cpp) both use it.
struct ParamState {
  double weight = 4;  // the weights as stored: f32 here, bf16/fp16 where f32 masters are apart
  double grad = 4;    // gradients, f32 (accumulated over micro-batches)
  double copy = 0;    // a low-precision copy of f32 weights for the GEMMs (this trainer's bf16)
  double master = 0;  // f32 master weights apart from low-precision weights
  double slots = 2;   // f32 optimizer state floats per parameter: AdamW 2, others 1
  int zero = 0;       // ZeRO stage, 0–3
};
// This trainer: f32 weights and gradients, the bf16/fp16 copy of a low-precision run
// (precision_bytes 2; 0 for f32), the optimizer's f32 state.
ParamState trainer_state(const std::string& optimizer, int precision_bytes, int zero);
// GPU mixed precision as Megatron-Core and DeepSpeed keep it: bf16/fp16 weights, f32 gradients
// (Megatron's main_grad), f32 master weights with the optimizer state (its distributed optimizer
// shards both: ZeRO-1).
ParamState mixed_precision_state(const std::string& optimizer, int zero);
// The bytes `params` parameters kept as `s` take on one process, the kinds ZeRO shards divided
// over `ranks`: parameters (weights), gradients, optimizer (master weights and slots),
// low_precision (copies). No activations.
MemoryEstimate state_memory(const ParamState& s, double params, double ranks);

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
