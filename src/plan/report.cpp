// The planner's outputs: JSON (one object per prediction) and the table `moetrain plan` prints.
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "plan/cost_model.h"

namespace moetrain::plan {

nlohmann::json to_json(const Prediction& p) {
  const StepParts& s = p.parts;
  const Memory& m = p.memory;
  return {
      {"procs", p.layout.procs},
      {"ep", p.layout.ep},
      {"dp", p.layout.dp()},
      {"tp", p.layout.tp},
      {"pp", p.layout.pp},
      {"vp", p.layout.vp},
      {"flops_per_device_s", p.flops_per_device_s},
      {"utilisation", p.utilisation},
      {"comm_efficiency", p.comm_efficiency},
      {"step_time_s", p.step_time_s},
      {"tokens_per_s", p.tokens_per_s},
      {"mfu", p.mfu},
      {"flops_per_step", p.flops_per_step},
      {"imbalance", p.imbalance},
      {"compute_share", p.compute_share},
      {"a2a_kind", p.a2a_kind},
      {"a2a_hierarchical_asked", p.hierarchical_asked},
      {"parts",
       {{"attention_s", s.attention},
        {"router_s", s.router},
        {"experts_s", s.experts},
        {"experts_balanced_s", s.experts_mean},
        {"shared_and_dense_ffn_s", s.shared_expert},
        {"norms_s", s.norms},
        {"lm_head_s", s.lm_head},
        {"optimizer_s", s.optimizer},
        {"compute_s", s.compute()},
        {"a2a_s", s.a2a},
        {"a2a_exposed_s", s.a2a_exposed},
        {"grad_sync_s", s.grad_sync},
        {"grad_sync_exposed_s", s.grad_sync_exposed},
        {"tensor_parallel_s", s.tensor_parallel},
        {"pipeline_bubble_s", s.pipeline_bubble},
        {"sync_s", s.sync}}},
      {"memory",
       {{"params_bytes", m.params},
        {"grads_bytes", m.grads},
        {"optimizer_bytes", m.optimizer},
        {"optimizer_without_zero_bytes", m.optimizer_without_zero},
        {"low_precision_bytes", m.low_precision},
        {"activations_bytes", m.activations},
        {"total_bytes", m.total()},
        {"fits", p.fits}}},
  };
}

namespace {

std::string ms(double s) {
  return fmt::format("{:.2f}", s * 1e3);
}

std::string mib(double b) {
  return fmt::format("{:.1f}", b / 1048576.0);
}

}  // namespace

std::string format_table(const std::vector<Prediction>& ps) {
  std::string out;
  auto row = [&](const std::string& name, auto&& value) {
    out += fmt::format("{:<26}", name);
    for (const auto& p : ps) out += fmt::format("{:>14}", value(p));
    out += "\n";
  };
  row("layout (procs/ep/dp)", [](const Prediction& p) {
    return fmt::format("{}/{}/{}", p.layout.procs, p.layout.ep, p.layout.dp());
  });
  if (std::any_of(ps.begin(), ps.end(),
                  [](const Prediction& p) { return p.layout.tp * p.layout.pp > 1; }))
    row("tp/pp/vp", [](const Prediction& p) {
      return fmt::format("{}/{}/{}", p.layout.tp, p.layout.pp, p.layout.vp);
    });
  row("step time ms", [](const Prediction& p) { return ms(p.step_time_s); });
  row("  attention ms", [](const Prediction& p) { return ms(p.parts.attention); });
  row("  router ms", [](const Prediction& p) { return ms(p.parts.router); });
  row("  experts ms (slowest)", [](const Prediction& p) { return ms(p.parts.experts); });
  row("  experts ms (balanced)", [](const Prediction& p) { return ms(p.parts.experts_mean); });
  row("  shared/dense FFN ms", [](const Prediction& p) { return ms(p.parts.shared_expert); });
  row("  norms/copies ms", [](const Prediction& p) { return ms(p.parts.norms); });
  row("  LM head + CE ms", [](const Prediction& p) { return ms(p.parts.lm_head); });
  row("  optimizer ms", [](const Prediction& p) { return ms(p.parts.optimizer); });
  row("  all-to-all ms", [](const Prediction& p) { return ms(p.parts.a2a); });
  row("    exposed ms", [](const Prediction& p) { return ms(p.parts.a2a_exposed); });
  row("    kind", [](const Prediction& p) { return p.a2a_kind; });
  if (std::any_of(ps.begin(), ps.end(), [](const Prediction& p) { return p.hierarchical_asked; }))
    row("    hierarchical asked",
        [](const Prediction& p) { return p.hierarchical_asked ? "yes" : "no"; });
  row("  grad reduction ms", [](const Prediction& p) { return ms(p.parts.grad_sync); });
  row("    exposed ms", [](const Prediction& p) { return ms(p.parts.grad_sync_exposed); });
  row("  tensor-parallel ms", [](const Prediction& p) { return ms(p.parts.tensor_parallel); });
  row("  pipeline bubble ms", [](const Prediction& p) { return ms(p.parts.pipeline_bubble); });
  row("  small collectives ms", [](const Prediction& p) { return ms(p.parts.sync); });
  row("imbalance (max/mean)",
      [](const Prediction& p) { return fmt::format("{:.2f}", p.imbalance); });
  row("tokens/s", [](const Prediction& p) { return fmt::format("{:.0f}", p.tokens_per_s); });
  row("  per device", [](const Prediction& p) {
    return fmt::format("{:.0f}", p.tokens_per_s / static_cast<double>(p.layout.procs));
  });
  row("MFU", [](const Prediction& p) { return fmt::format("{:.3f}", p.mfu); });
  row("TFLOP/s per device",
      [](const Prediction& p) { return fmt::format("{:.1f}", p.flops_per_device_s * 1e-12); });
  row("utilisation", [](const Prediction& p) { return fmt::format("{:.2f}", p.utilisation); });
  row("comm efficiency",
      [](const Prediction& p) { return fmt::format("{:.2f}", p.comm_efficiency); });
  row("memory MiB/device", [](const Prediction& p) { return mib(p.memory.total()); });
  row("  params", [](const Prediction& p) { return mib(p.memory.params); });
  row("  grads", [](const Prediction& p) { return mib(p.memory.grads); });
  row("  optimizer", [](const Prediction& p) { return mib(p.memory.optimizer); });
  row("  (without ZeRO-1)",
      [](const Prediction& p) { return mib(p.memory.optimizer_without_zero); });
  row("  low-precision copies", [](const Prediction& p) { return mib(p.memory.low_precision); });
  row("  activations", [](const Prediction& p) { return mib(p.memory.activations); });
  row("fits", [](const Prediction& p) { return p.fits ? "yes" : "NO"; });
  return out;
}

}  // namespace moetrain::plan
