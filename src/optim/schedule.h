// Learning-rate schedule: a pure function of the step, so a resumed run needs only its step.
//
// `step` counts the updates already applied (the first update uses step 0). With W = warmup_steps,
// S = total_steps, peak = lr, lo = min_lr, init = warmup_init:
//   step < W:            lr(step) = init + (peak − init) · step / W
//   kind constant:       lr(step) = peak                                   for step ≥ W
//   kind cosine, linear: p = (step − W) / (S − W)                          for W ≤ step < S
//     cosine:            lr(step) = lo + (peak − lo) · (1 + cos(π·p)) / 2
//     linear:            lr(step) = peak + (lo − peak) · p
//                        lr(step) = lo                                     for step ≥ S
// So lr(0) = init, lr(W) = peak (when W < S), lr(S) = lo and it stays there.
#pragma once
#include <cstdint>
#include <string_view>

namespace moetrain {

enum class ScheduleKind { Constant, Cosine, Linear };

// "constant" | "cosine" | "linear"; anything else throws, listing the allowed names.
ScheduleKind parse_schedule_kind(std::string_view name);
std::string_view schedule_kind_name(ScheduleKind kind);

struct ScheduleConfig {
  ScheduleKind kind = ScheduleKind::Cosine;
  double lr = 3e-4;          // peak, reached at the end of warmup
  double min_lr = 0.0;       // cosine / linear: reached at total_steps
  double warmup_init = 0.0;  // lr at step 0
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;  // cosine / linear: end of decay; unused by constant

  // Throws naming the field and its value: lr, min_lr, warmup_init finite and ≥ 0,
  // min_lr ≤ lr, warmup_init ≤ lr, warmup_steps ≥ 0, and for cosine / linear
  // warmup_steps ≤ total_steps.
  void validate() const;
};

class LrSchedule {
 public:
  explicit LrSchedule(const ScheduleConfig& config);  // validates
  // The learning rate for the update with index `step` (≥ 0).
  double lr(int64_t step) const;
  const ScheduleConfig& config() const { return config_; }

 private:
  ScheduleConfig config_;
};

}  // namespace moetrain
