#include "optim/schedule.h"

#include <cmath>
#include <numbers>

#include "core/check.h"

namespace moetrain {

namespace {
void check_rate(double value, const char* field) {
  MOETRAIN_CHECK(std::isfinite(value) && value >= 0.0,
                 "schedule config: {} = {} must be finite and >= 0", field, value);
}
}  // namespace

ScheduleKind parse_schedule_kind(std::string_view name) {
  if (name == "constant") return ScheduleKind::Constant;
  if (name == "cosine") return ScheduleKind::Cosine;
  if (name == "linear") return ScheduleKind::Linear;
  MOETRAIN_FAIL("unknown lr schedule '{}': allowed are constant, cosine, linear", name);
}

std::string_view schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::Constant:
      return "constant";
    case ScheduleKind::Cosine:
      return "cosine";
    case ScheduleKind::Linear:
      return "linear";
  }
  MOETRAIN_FAIL("invalid schedule kind {}", static_cast<int>(kind));
}

void ScheduleConfig::validate() const {
  schedule_kind_name(kind);
  check_rate(lr, "lr");
  check_rate(min_lr, "min_lr");
  check_rate(warmup_init, "warmup_init");
  MOETRAIN_CHECK(min_lr <= lr, "schedule config: min_lr = {} must be <= lr = {}", min_lr, lr);
  MOETRAIN_CHECK(warmup_init <= lr, "schedule config: warmup_init = {} must be <= lr = {}",
                 warmup_init, lr);
  MOETRAIN_CHECK(warmup_steps >= 0, "schedule config: warmup_steps = {} must be >= 0",
                 warmup_steps);
  MOETRAIN_CHECK(total_steps >= 0, "schedule config: total_steps = {} must be >= 0", total_steps);
  MOETRAIN_CHECK(kind == ScheduleKind::Constant || warmup_steps <= total_steps,
                 "schedule config: warmup_steps = {} must be <= total_steps = {} for a {} schedule",
                 warmup_steps, total_steps, schedule_kind_name(kind));
}

LrSchedule::LrSchedule(const ScheduleConfig& config) : config_(config) {
  config_.validate();
}

double LrSchedule::lr(int64_t step) const {
  MOETRAIN_CHECK(step >= 0, "lr schedule: step {} must be >= 0", step);
  const ScheduleConfig& c = config_;
  if (step < c.warmup_steps) {
    return c.warmup_init + (c.lr - c.warmup_init) * double(step) / double(c.warmup_steps);
  }
  if (c.kind == ScheduleKind::Constant) return c.lr;
  if (step >= c.total_steps) return c.min_lr;
  const double p = double(step - c.warmup_steps) / double(c.total_steps - c.warmup_steps);
  if (c.kind == ScheduleKind::Cosine) {
    return c.min_lr + (c.lr - c.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
  }
  return c.lr + (c.min_lr - c.lr) * p;
}

}  // namespace moetrain
