#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/profile.h"
#include "optim/adagrad.h"
#include "optim/adamw.h"
#include "optim/rmsprop.h"
#include "optim/sgd.h"

namespace moetrain {

namespace {

struct KindName {
  OptimizerKind kind;
  std::string_view name;
};
constexpr KindName kKindNames[] = {{OptimizerKind::AdamW, "adamw"},
                                   {OptimizerKind::Sgd, "sgd"},
                                   {OptimizerKind::AdaGrad, "adagrad"},
                                   {OptimizerKind::RmsProp, "rmsprop"}};

// Written so that NaN fails every check.
void check_finite(double value, const char* field) {
  MOETRAIN_CHECK(std::isfinite(value), "optimizer config: {} = {} must be finite", field, value);
}
void check_unit_interval_open(double value, const char* field) {
  check_finite(value, field);
  MOETRAIN_CHECK(value >= 0.0 && value < 1.0, "optimizer config: {} = {} must be in [0, 1)", field,
                 value);
}
void check_non_negative(double value, const char* field) {
  check_finite(value, field);
  MOETRAIN_CHECK(value >= 0.0, "optimizer config: {} = {} must be >= 0", field, value);
}

// Groups sorted by offset, checked to tile [0, total).
std::vector<ParamRange> sorted_tiling(std::span<const ParamRange> groups) {
  std::vector<ParamRange> sorted(groups.begin(), groups.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    MOETRAIN_CHECK(sorted[i].offset >= 0 && sorted[i].size >= 0,
                   "parameter group {}: offset {} and size {} must be >= 0", i, sorted[i].offset,
                   sorted[i].size);
  }
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const ParamRange& a, const ParamRange& b) { return a.offset < b.offset; });
  int64_t expected = 0;
  for (const ParamRange& g : sorted) {
    MOETRAIN_CHECK(g.offset == expected,
                   "parameter groups must tile the buffer: a group starts at {}, expected {} ({})",
                   g.offset, expected, g.offset < expected ? "overlap" : "gap");
    expected = g.offset + g.size;
  }
  return sorted;
}

}  // namespace

OptimizerKind parse_optimizer_kind(std::string_view name) {
  for (const KindName& k : kKindNames) {
    if (k.name == name) return k.kind;
  }
  MOETRAIN_FAIL("unknown optimizer '{}': allowed are adamw, sgd, adagrad, rmsprop", name);
}

std::string_view optimizer_kind_name(OptimizerKind kind) {
  for (const KindName& k : kKindNames) {
    if (k.kind == kind) return k.name;
  }
  MOETRAIN_FAIL("invalid optimizer kind {}", static_cast<int>(kind));
}

void OptimizerConfig::validate() const {
  optimizer_kind_name(kind);
  check_unit_interval_open(beta1, "beta1");
  check_unit_interval_open(beta2, "beta2");
  check_finite(eps, "eps");
  MOETRAIN_CHECK(eps > 0.0, "optimizer config: eps = {} must be > 0", eps);
  check_non_negative(weight_decay, "weight_decay");
  check_unit_interval_open(momentum, "momentum");
  MOETRAIN_CHECK(!nesterov || momentum > 0.0,
                 "optimizer config: nesterov = true needs momentum > 0 (momentum = {})", momentum);
  check_finite(alpha, "alpha");
  MOETRAIN_CHECK(alpha >= 0.0 && alpha <= 1.0, "optimizer config: alpha = {} must be in [0, 1]",
                 alpha);
  check_non_negative(lr_decay, "lr_decay");
  check_non_negative(initial_accumulator_value, "initial_accumulator_value");
}

OptimizerConfig default_optimizer_config(OptimizerKind kind) {
  OptimizerConfig c;
  c.kind = kind;
  switch (kind) {
    case OptimizerKind::AdamW:
      break;
    case OptimizerKind::Sgd:
      c.weight_decay = 0.0;
      c.momentum = 0.9;
      break;
    case OptimizerKind::AdaGrad:
      c.weight_decay = 0.0;
      c.eps = 1e-10;
      break;
    case OptimizerKind::RmsProp:
      c.weight_decay = 0.0;
      break;
  }
  return c;
}

int64_t param_ranges_total(std::span<const ParamRange> groups) {
  auto sorted = sorted_tiling(groups);
  return sorted.empty() ? 0 : sorted.back().offset + sorted.back().size;
}

std::vector<DecaySegment> decay_segments(std::span<const ParamRange> groups, int64_t begin,
                                         int64_t end) {
  auto sorted = sorted_tiling(groups);
  const int64_t total = sorted.empty() ? 0 : sorted.back().offset + sorted.back().size;
  MOETRAIN_CHECK(0 <= begin && begin <= end && end <= total,
                 "optimizer range [{}, {}) must lie within the parameter buffer [0, {})", begin,
                 end, total);
  std::vector<DecaySegment> out;
  // First group whose end lies past `begin`; from there on, groups until one reaches `end`.
  auto it =
      std::upper_bound(sorted.begin(), sorted.end(), begin,
                       [](int64_t pos, const ParamRange& g) { return pos < g.offset + g.size; });
  for (; it != sorted.end() && it->offset < end; ++it) {
    const int64_t lo = std::max(it->offset, begin) - begin;
    const int64_t hi = std::min(it->offset + it->size, end) - begin;
    if (hi <= lo) continue;
    if (!out.empty() && out.back().end == lo && out.back().weight_decay == it->weight_decay) {
      out.back().end = hi;
    } else {
      out.push_back({lo, hi, it->weight_decay});
    }
  }
  return out;
}

Optimizer::Optimizer(const OptimizerConfig& config, std::span<const ParamRange> groups,
                     int64_t begin, int64_t end, std::vector<StateSpec> specs,
                     StateStorage storage)
    : config_(config),
      begin_(begin),
      end_(end),
      segments_(decay_segments(groups, begin, end)),
      specs_(std::move(specs)) {
  config_.validate();
  if (storage == StateStorage::Owned)
    for (const StateSpec& sp : specs_)
      owned_.emplace_back(static_cast<std::size_t>(size()), sp.initial);
}

std::vector<StateBuffer> Optimizer::state() {
  std::vector<StateBuffer> out;
  for (std::size_t s = 0; s < specs_.size(); ++s)
    out.push_back({specs_[s].name, owned_.empty() ? std::span<float>() : std::span(owned_[s])});
  return out;
}

void Optimizer::set_step_count(int64_t steps) {
  MOETRAIN_CHECK(steps >= 0, "optimizer step count {} must be >= 0", steps);
  step_count_ = steps;
}

std::vector<DecaySegment> without_frozen(const std::vector<DecaySegment>& segments, int64_t begin,
                                         std::span<const FrozenRange> frozen) {
  std::vector<FrozenRange> cuts(frozen.begin(), frozen.end());
  std::sort(cuts.begin(), cuts.end(),
            [](const FrozenRange& a, const FrozenRange& b) { return a.offset < b.offset; });
  std::vector<DecaySegment> out;
  for (const DecaySegment& s : segments) {
    int64_t at = s.begin;
    for (const FrozenRange& f : cuts) {
      const int64_t lo = std::max(f.offset - begin, at),
                    hi = std::min(f.offset + f.size - begin, s.end);
      if (hi <= lo) continue;
      if (lo > at) out.push_back({at, lo, s.weight_decay});
      at = hi;
    }
    if (at < s.end) out.push_back({at, s.end, s.weight_decay});
  }
  return out;
}

void Optimizer::begin_step(float lr, std::span<const FrozenRange> frozen) {
  MOETRAIN_CHECK(std::isfinite(lr) && lr >= 0.0f, "optimizer step: lr = {} must be finite and >= 0",
                 lr);
  MOETRAIN_CHECK(!in_step_, "optimizer step: begin_step inside a step");
  ++step_count_;
  in_step_ = true;
  lr_ = lr;
  active_ = frozen.empty() ? segments_ : without_frozen(segments_, begin_, frozen);
}

void Optimizer::step_part(int64_t lo, int64_t hi, float* params, const float* grads,
                          float* const* state, const LowPrecisionCopy& lp) {
  MOETRAIN_CHECK(in_step_, "optimizer step: step_part outside begin_step / end_step");
  MOETRAIN_CHECK(0 <= lo && lo <= hi && hi <= size(),
                 "optimizer step: part [{}, {}) outside the range of {} elements", lo, hi, size());
  MOETRAIN_CHECK(lo == hi || (params != nullptr && grads != nullptr),
                 "optimizer step: null params or grads for a part of {} elements", hi - lo);
  MOETRAIN_CHECK(!lp.data || lp.type == DType::BF16 || lp.type == DType::F16,
                 "optimizer step: a low-precision copy must be bf16 or fp16, got {}",
                 dtype_name(lp.type));
  // The step's segments cut to [lo, hi), relative to lo.
  part_.clear();
  for (const DecaySegment& s : active_) {
    const int64_t b = std::max(s.begin, lo), e = std::min(s.end, hi);
    if (b < e) part_.push_back({b - lo, e - lo, s.weight_decay});
  }
  part_size_ = hi - lo;
  // update() sees the part's copy; it is cleared however it leaves.
  struct During {
    Optimizer& o;
    ~During() { o.lp_ = {}; }
  } during{*this};
  lp_ = lp;
  update(params, grads, state, lr_);
  if (lp.data && !writes_lp_copy(lp.type)) {
    for (const DecaySegment& s : part_)
      f32_to_dtype(lp.type, lp.at(s.begin).data, params + s.begin,
                   static_cast<std::size_t>(s.end - s.begin));
  }
}

void Optimizer::end_step() {
  in_step_ = false;
  active_.clear();
  part_.clear();
}

void Optimizer::step(float* params, const float* grads, float lr,
                     std::span<const FrozenRange> frozen, const LowPrecisionCopy& lp) {
  PhaseScope phase_scope(Phase::Optimizer);
  MOETRAIN_CHECK(owned_.size() == specs_.size(),
                 "optimizer step: the state is held outside the optimizer; step it in parts");
  MOETRAIN_CHECK(size() == 0 || (params != nullptr && grads != nullptr),
                 "optimizer step: null params or grads for a range of {} elements", size());
  std::vector<float*> state;
  for (std::vector<float>& v : owned_) state.push_back(v.data());
  begin_step(lr, frozen);
  struct Ending {
    Optimizer& o;
    ~Ending() { o.end_step(); }
  } ending{*this};
  step_part(0, size(), params, grads, state.data(), lp);
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& config,
                                          std::span<const ParamRange> groups, int64_t begin,
                                          int64_t end, StateStorage storage) {
  config.validate();
  switch (config.kind) {
    case OptimizerKind::AdamW:
      return std::make_unique<AdamW>(config, groups, begin, end, storage);
    case OptimizerKind::Sgd:
      return std::make_unique<Sgd>(config, groups, begin, end, storage);
    case OptimizerKind::AdaGrad:
      return std::make_unique<AdaGrad>(config, groups, begin, end, storage);
    case OptimizerKind::RmsProp:
      return std::make_unique<RmsProp>(config, groups, begin, end, storage);
  }
  MOETRAIN_FAIL("invalid optimizer kind {}", static_cast<int>(config.kind));
}

}  // namespace moetrain
