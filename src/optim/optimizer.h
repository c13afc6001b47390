// Optimizers over one flat parameter buffer. Gradients and optimizer state mirror the parameter
// buffer (same offsets), so an optimizer is a loop over a range [begin, end) of it. An instance
// owns one range and holds state for that range only: ZeRO-1 gives each data-parallel rank its
// slice, the parameter server gives each server its key range. The update is elementwise, so an
// element gets bitwise the same result whatever range (and thread count) it is updated in.
//
// Weight decay is chosen per parameter group: a list of ParamRange tiling the buffer (norm
// weights and router biases get none). An optimizer intersects the groups with its range once, at
// construction, into a few segments, and its loops run per segment.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/dtype.h"

namespace moetrain {

enum class OptimizerKind { AdamW, Sgd, AdaGrad, RmsProp };

// "adamw" | "sgd" | "adagrad" | "rmsprop"; anything else throws, listing the allowed names.
OptimizerKind parse_optimizer_kind(std::string_view name);
std::string_view optimizer_kind_name(OptimizerKind kind);

// Hyper-parameters of every kind; each kind reads the fields it uses. The learning rate is not
// here: it comes from the schedule, one value per step() call.
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::AdamW;
  double beta1 = 0.9;         // AdamW
  double beta2 = 0.95;        // AdamW
  double eps = 1e-8;          // AdamW, AdaGrad, RMSProp
  double weight_decay = 0.1;  // AdamW: decoupled; SGD, AdaGrad, RMSProp: added to the gradient
  double momentum = 0.0;      // SGD, RMSProp
  bool nesterov = false;      // SGD (needs momentum > 0)
  double alpha = 0.99;        // RMSProp smoothing constant
  bool centered = false;      // RMSProp: divide by the estimated variance instead
  double lr_decay = 0.0;      // AdaGrad: lr_t = lr / (1 + (t − 1)·lr_decay)
  double initial_accumulator_value = 0.0;  // AdaGrad

  // Throws naming the field and its value: β outside [0, 1), eps ≤ 0, negative decay or
  // momentum, α outside [0, 1], nesterov without momentum, non-finite values.
  void validate() const;
};

// The defaults of `kind`: PyTorch's, except AdamW (β2 0.95, weight decay 0.1, as LLM training
// uses) and SGD (momentum 0.9, since plain SGD is rarely what is wanted). AdaGrad eps is 1e-10;
// SGD, AdaGrad and RMSProp default to no weight decay.
OptimizerConfig default_optimizer_config(OptimizerKind kind);
inline OptimizerConfig default_optimizer_config(std::string_view name) {
  return default_optimizer_config(parse_optimizer_kind(name));
}

// One parameter group: elements [offset, offset + size) of the flat buffer.
struct ParamRange {
  int64_t offset = 0;
  int64_t size = 0;
  bool weight_decay = true;
};

// A run of elements with one decay flag; begin/end are relative to the range the caller asked for.
struct DecaySegment {
  int64_t begin = 0;
  int64_t end = 0;
  bool weight_decay = true;
};

// Sum of the group sizes; throws unless the groups (in any order) tile [0, total) exactly.
int64_t param_ranges_total(std::span<const ParamRange> groups);

// The groups intersected with [begin, end), as segments relative to `begin`, adjacent segments
// with the same flag merged, empty ones dropped. Throws unless the groups tile [0, total) and
// 0 ≤ begin ≤ end ≤ total.
std::vector<DecaySegment> decay_segments(std::span<const ParamRange> groups, int64_t begin,
                                         int64_t end);

// Elements [offset, offset + size) of the flat buffer that one step leaves exactly as they are:
// parameters and state (sparse experts, optim/sparse_experts.h: the rows of an expert no token
// reached). The step count still advances for the whole range, as in PyTorch's SparseAdam, whose
// `step` is per tensor, not per row: a row updated again later is bias-corrected with the global t.
struct FrozenRange {
  int64_t offset = 0, size = 0;
};

// segments (relative to `begin`) minus the frozen ranges (absolute, any order, may overlap).
std::vector<DecaySegment> without_frozen(const std::vector<DecaySegment>& segments, int64_t begin,
                                         std::span<const FrozenRange> frozen);

// A named optimizer state buffer over the owned range (element i is flat element begin + i).
struct StateBuffer {
  std::string name;
  std::span<float> values;  // (end - begin)
};

// One state buffer's name and the value every element starts at.
struct StateSpec {
  std::string name;
  float initial = 0.0f;
};

// Where an optimizer's state lives: in its own vectors, or with the caller (the offload store,
// optim/offload_store.h), who hands each part of a step the state of that part.
enum class StateStorage { Owned, External };

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of the owned range at learning rate `lr` (finite, ≥ 0): advances the step count,
  // then updates params and state. Element i of params / grads is flat element begin() + i, so
  // a caller holding the whole buffer passes `buffer + begin()`.
  // params, grads (end - begin). Elements inside `frozen` (absolute flat offsets) are skipped:
  // no decay, no state update, no parameter change. lp (like params, element i is flat element
  // begin() + i): every updated element's new value rounded to lp.type is written there too;
  // skipped elements are left as they are. Needs owned state; it is begin_step, one
  // step_part over the whole range with that state, end_step.
  void step(float* params, const float* grads, float lr, std::span<const FrozenRange> frozen = {},
            const LowPrecisionCopy& lp = {});

  // The same step in parts, for state held elsewhere: begin_step advances the step count and
  // fixes lr and the frozen ranges; each step_part updates elements [lo, hi) of the range (parts
  // disjoint, any order), element i of params / grads / lp / state[s] being range element lo + i;
  // end_step closes the step. The update is elementwise, so any cut into parts gives every
  // element the bits of step(). The caller times the parts as Phase::Optimizer (step() does).
  void begin_step(float lr, std::span<const FrozenRange> frozen = {});
  void step_part(int64_t lo, int64_t hi, float* params, const float* grads,
                 float* const* state, const LowPrecisionCopy& lp = {});
  void end_step();

  // The state buffers by name, for checkpoints: AdamW "exp_avg", "exp_avg_sq"; SGD "momentum"
  // (none when momentum is 0); AdaGrad "sum_sq"; RMSProp "square_avg", then "momentum" when
  // momentum > 0 and "grad_avg" when centered. Loading writes into these spans. External
  // storage: empty spans (the holder has the values).
  std::vector<StateBuffer> state();
  // Names and initial values of the state buffers, in state() order.
  const std::vector<StateSpec>& state_specs() const { return specs_; }

  // Number of step() calls applied to the state; part of the state (bias corrections, SGD's
  // first momentum step, AdaGrad's lr decay depend on it). Set it when loading a checkpoint.
  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t steps);

  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  int64_t size() const { return end_ - begin_; }
  const OptimizerConfig& config() const { return config_; }
  const std::vector<DecaySegment>& segments() const { return segments_; }

 protected:
  // specs: the state buffers (allocated here with their initial values unless `storage` is
  // External).
  Optimizer(const OptimizerConfig& config, std::span<const ParamRange> groups, int64_t begin,
            int64_t end, std::vector<StateSpec> specs, StateStorage storage);
  // Called by step_part() after the step count advanced; `step_count()` is the 1-based step t.
  // params, grads, state[s] (one per state_specs() entry): element i is element i of the part
  // being updated, whose segments for_each_segment() walks.
  virtual void update(float* params, const float* grads, float* const* state, float lr) = 0;
  // Whether update() writes a copy of type t itself (in its own pass); otherwise step_part()
  // rounds the updated segments into lp_copy() afterwards.
  virtual bool writes_lp_copy(DType /*t*/) const { return false; }
  // During step_part(): the part's low-precision copy to keep (no data when there is none).
  const LowPrecisionCopy& lp_copy() const { return lp_; }

  // Runs body(lo, hi, weight_decay) for every segment of the part being updated, all inside one
  // OpenMP parallel region (when the part is large enough). The body must split [lo, hi) with an
  // orphaned `#pragma omp for ... nowait`: segments write disjoint elements, so no barrier is
  // needed between them, and the result of each element does not depend on which thread
  // computes it.
  template <class Body>
  void for_each_segment(Body&& body) const {
    const int64_t n = part_size_;
    const std::vector<DecaySegment>& segs = part_;
#pragma omp parallel if (n > kParallelMin)
    for (const DecaySegment& s : segs) body(s.begin, s.end, s.weight_decay);
  }

  static constexpr int64_t kParallelMin = 1 << 14;

 private:
  OptimizerConfig config_;
  int64_t begin_;
  int64_t end_;
  int64_t step_count_ = 0;
  std::vector<DecaySegment> segments_;
  std::vector<StateSpec> specs_;
  std::vector<std::vector<float>> owned_;  // one per spec; empty when External
  // During a step: lr, the segments it updates (segments_ less its frozen ranges), and for the
  // part being updated its segments (relative to the part), size and copy.
  bool in_step_ = false;
  float lr_ = 0.0f;
  std::vector<DecaySegment> active_;
  std::vector<DecaySegment> part_;
  int64_t part_size_ = 0;
  LowPrecisionCopy lp_;
};

// Calls f(std::true_type) or f(std::false_type): turns a runtime flag into a template argument, so
// that hot loops are compiled once per combination, free of branches.
template <class F>
void with_flag(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Validates the config and builds the optimizer of config.kind for [begin, end) of the buffer
// tiled by `groups`, with zero state (AdaGrad: initial_accumulator_value), or none of its own
// (External: stepped by begin_step / step_part / end_step).
std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& config,
                                          std::span<const ParamRange> groups, int64_t begin,
                                          int64_t end,
                                          StateStorage storage = StateStorage::Owned);

}  // namespace moetrain
