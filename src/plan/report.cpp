// The planner's outputs: JSON (one object per prediction) and the table `moetrain plan` prints.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "plan/cost_model.h"

namespace moetrain::plan {

namespace {

nlohmann::json collective_json(const Collective& c) {
  nlohmann::json phases = nlohmann::json::array();
  for (const LinkPhase& ph : c.phases)
    phases.push_back({{"name", ph.name},
                      {"messages", ph.messages},
                      {"latency_s", ph.latency},
                      {"bytes", ph.bytes},
                      {"bandwidth", ph.bandwidth},
                      {"sharing", ph.sharing},
                      {"latency_part_s", ph.latency_s()},
                      {"transfer_part_s", ph.transfer_s()}});
  return {{"kind", c.kind}, {"concurrent", c.concurrent}, {"seconds", c.seconds()},
          {"phases", phases}};
}

nlohmann::json comm_json(const CommBreakdown& c) {
  nlohmann::json reductions = nlohmann::json::array();
  for (const auto& [name, r] : c.reductions) {
    nlohmann::json j = collective_json(r);
    j["name"] = name;
    reductions.push_back(j);
  }
  return {{"a2a",
           {{"exchanges_per_step", c.a2a_exchanges},
            {"send_bytes", c.a2a_send_bytes},
            {"hot_recv_bytes", c.a2a_hot_recv_bytes},
            {"charged_bytes", c.a2a_charged_bytes},
            {"late_s", c.a2a_late_s},
            {"runs", c.a2a_runs},
            {"flat", collective_json(c.a2a_flat)},
            {"hierarchical", collective_json(c.a2a_hierarchical)},
            {"deduplicated", collective_json(c.a2a_deduplicated)}}},
          {"reductions", reductions},
          {"tensor_parallel",
           {{"per_step", c.tp_count}, {"each", collective_json(c.tensor_parallel)}}},
          {"expert_tensor_parallel",
           {{"per_step", c.etp_count},
            {"bytes", c.expert_tensor_parallel_bytes},
            {"each", collective_json(c.expert_tensor_parallel)}}},
          {"pipeline",
           {{"schedule", c.pipe_schedule},
            {"sends_per_step", c.pipe_sends},
            {"each", collective_json(c.pipeline_send)}}}};
}

}  // namespace

nlohmann::json to_json(const Prediction& p) {
  const StepParts& s = p.parts;
  const Memory& m = p.memory;
  return {
      {"procs", p.layout.procs},
      {"ep", p.layout.ep},
      {"etp", p.layout.etp},
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
      {"experts_active", p.experts_active},
      {"compute_share", p.compute_share},
      {"a2a_kind", p.a2a_kind},
      {"a2a_overlap", p.layout.a2a_overlap},
      {"recompute_modules", recompute_modules_name(p.layout.recompute_modules)},
      {"pp_account", pp_account_name(p.layout)},
      {"pp_first_layers", p.layout.pp_first_layers},
      {"pp_last_layers", p.layout.pp_last_layers},
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
        {"sync_s", s.sync},
        {"comm_contention_s", s.comm_contention}}},
      {"memory",
       {{"params_bytes", m.params},
        {"grads_bytes", m.grads},
        {"optimizer_bytes", m.optimizer},
        {"optimizer_without_zero_bytes", m.optimizer_without_zero},
        {"low_precision_bytes", m.low_precision},
        {"activations_bytes", m.activations},
        {"buffers_bytes", m.buffers},
        {"total_bytes", m.total()},
        {"fits", p.fits}}},
      {"trainer_runs", p.trainer_runs()},
      {"planner_only", p.planner_only},
      {"comm", comm_json(p.comm)},
  };
}

namespace {

std::string ms(double s) {
  return fmt::format("{:.2f}", s * 1e3);
}

std::string gib(double b) {
  return fmt::format("{:.4g}", b / 1073741824.0);
}

// Seconds, bytes and rates in the unit that reads best.
std::string duration(double s) {
  if (s >= 1) return fmt::format("{:.4g} s", s);
  if (s >= 1e-3) return fmt::format("{:.4g} ms", s * 1e3);
  return fmt::format("{:.4g} µs", s * 1e6);
}

std::string amount(double b) {
  if (b >= 1e9) return fmt::format("{:.4g} GB", b * 1e-9);
  if (b >= 1e6) return fmt::format("{:.4g} MB", b * 1e-6);
  if (b >= 1e3) return fmt::format("{:.4g} kB", b * 1e-3);
  return fmt::format("{:.4g} B", b);
}

std::string rate(double bps) {
  if (bps >= 1e9) return fmt::format("{:.4g} GB/s", bps * 1e-9);
  return fmt::format("{:.4g} MB/s", bps * 1e-6);
}

// A whole count as one (what a stage's share of the layers leaves within rounding of it), a
// stage's mean share of a count that does not divide as it is.
std::string count(double n) {
  const bool whole = std::abs(n - std::round(n)) <= 1e-9 * std::max(1.0, std::abs(n));
  return whole ? fmt::format("{:.0f}", n) : fmt::format("{:.2f}", n);
}

std::string latency_term(const LinkPhase& ph) {
  return fmt::format("{} × {}", count(ph.messages), duration(ph.latency));
}

std::string transfer_term(const LinkPhase& ph) {
  if (ph.sharing > 1)
    return fmt::format("{} / ({} / {} ranks)", amount(ph.bytes), rate(ph.bandwidth),
                       count(ph.sharing));
  return fmt::format("{} / {}", amount(ph.bytes), rate(ph.bandwidth));
}

// "= …" : the collective's time as the model computes it from its phases.
std::string formula(const Collective& c) {
  if (c.phases.empty()) return "nothing travels";
  std::vector<std::string> terms;
  if (c.concurrent) {
    std::vector<std::string> transfers;
    for (const LinkPhase& ph : c.phases) {
      transfers.push_back(fmt::format("{} {}", ph.name, transfer_term(ph)));
      if (ph.messages > 0) terms.push_back(latency_term(ph));
    }
    const std::string slowest = transfers.size() == 1
                                    ? transfers[0]
                                    : fmt::format("max({})", fmt::join(transfers, ", "));
    if (terms.empty()) return slowest;
    return fmt::format("{} + {}", slowest, fmt::join(terms, " + "));
  }
  for (const LinkPhase& ph : c.phases) {
    std::string t = ph.name + " ";
    if (ph.messages > 0) t += latency_term(ph) + " + ";
    terms.push_back(t + transfer_term(ph));
  }
  return fmt::format("{}", fmt::join(terms, ", then "));
}

}  // namespace

std::string format_comm(const Prediction& p) {
  if (p.layout.procs == 1) return "communication: none (one process)\n";
  const CommBreakdown& c = p.comm;
  const StepParts& s = p.parts;
  std::string out =
      "communication, written out (one rank: messages × latency + bytes / (link bandwidth / "
      "ranks sharing it))\n";
  if (c.a2a_exchanges > 0) {
    out += fmt::format(
        "  all-to-all: {} exchanges a step; a rank sends {} an exchange, the most loaded rank "
        "receives {}, the link is charged {}\n",
        count(c.a2a_exchanges), amount(c.a2a_send_bytes), amount(c.a2a_hot_recv_bytes),
        amount(c.a2a_charged_bytes));
    out += fmt::format("    {:<14}{:>11} = {}\n", "flat", duration(c.a2a_flat.seconds()),
                       formula(c.a2a_flat));
    if (c.a2a_hierarchical.kind == "hierarchical")
      out += fmt::format("    {:<14}{:>11} = {}\n", "hierarchical",
                         duration(c.a2a_hierarchical.seconds()), formula(c.a2a_hierarchical));
    else
      out += fmt::format("    {:<14}{:>11}   (the expert group fits in one node: flat)\n",
                         "hierarchical", "—");
    if (c.a2a_deduplicated.kind == "deduplicated")
      out += fmt::format("    {:<14}{:>11} = {}\n", "deduplicated",
                         duration(c.a2a_deduplicated.seconds()), formula(c.a2a_deduplicated));
    const Collective& run = c.a2a_runs == "hierarchical"   ? c.a2a_hierarchical
                            : c.a2a_runs == "deduplicated" ? c.a2a_deduplicated
                                                           : c.a2a_flat;
    const std::string each =
        c.a2a_late_s > 0
            ? fmt::format("({} + a late peer's {})", duration(run.seconds()), duration(c.a2a_late_s))
            : duration(run.seconds());
    out += fmt::format("    the run ({}): {} × {} = {} a step, {} exposed\n", c.a2a_runs,
                       count(c.a2a_exchanges), each, duration(s.a2a), duration(s.a2a_exposed));
  } else {
    out += "  all-to-all: none (no expert parallelism)\n";
  }
  out += "  gradient reduction, once a step:\n";
  for (const auto& [name, r] : c.reductions) {
    if (r.phases.empty())
      out += fmt::format("    {:<36}{:>11}   nothing travels\n", name, "—");
    else
      out += fmt::format("    {:<36}{:>11} = {}\n", name, duration(r.seconds()), formula(r));
  }
  out += fmt::format("    the step: {}, {} exposed\n", duration(s.grad_sync),
                     duration(s.grad_sync_exposed));
  if (c.tp_count > 0)
    out += fmt::format("  tensor parallelism: {} all-reduces a step of {} = {}; {} a step\n",
                       count(c.tp_count), duration(c.tensor_parallel.seconds()),
                       formula(c.tensor_parallel),
                       duration(c.tp_count * c.tensor_parallel.seconds()));
  if (c.etp_count > 0)
    out += fmt::format(
        "  expert tensor parallelism: {} all-gather + reduce-scatter pairs a step of {} = {}; "
        "{} a step\n",
        count(c.etp_count), duration(c.expert_tensor_parallel.seconds()),
        formula(c.expert_tensor_parallel),
        duration(c.etp_count * c.expert_tensor_parallel.seconds()));
  if (c.pipe_sends > 0)
    out += fmt::format("  pipeline ({}): {} sends a step of {} = {}; bubble {} a step\n",
                       c.pipe_schedule, count(c.pipe_sends),
                       duration(c.pipeline_send.seconds()), formula(c.pipeline_send),
                       duration(s.pipeline_bubble));
  return out;
}

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
  if (std::any_of(ps.begin(), ps.end(), [](const Prediction& p) { return p.layout.etp > 1; }))
    row("expert tensor shards", [](const Prediction& p) { return fmt::format("{}", p.layout.etp); });
  if (std::any_of(ps.begin(), ps.end(),
                  [](const Prediction& p) { return p.layout.tp * p.layout.pp > 1; }))
    row("tp/pp/vp", [](const Prediction& p) {
      return fmt::format("{}/{}/{}", p.layout.tp, p.layout.pp, p.layout.vp);
    });
  if (std::any_of(ps.begin(), ps.end(), [](const Prediction& p) {
        return p.layout.pp_embedding_unit || p.layout.pp_loss_unit;
      }))
    row("pipeline split units", [](const Prediction& p) {
      const std::string u = pp_account_name(p.layout);
      return u.empty() ? std::string("blocks only") : u;
    });
  if (std::any_of(ps.begin(), ps.end(), [](const Prediction& p) { return p.layout.pp_uneven(); }))
    row("blocks a stage (first/middle/last)", [](const Prediction& p) {
      return p.pp_split.empty() ? std::string("even") : p.pp_split;
    });
  if (std::any_of(ps.begin(), ps.end(),
                  [](const Prediction& p) { return p.layout.recompute_modules.any(); }))
    row("recomputed modules", [](const Prediction& p) {
      const std::string m = recompute_modules_name(p.layout.recompute_modules);
      return m.empty() ? std::string("none") : m;
    });
  if (std::any_of(ps.begin(), ps.end(), [](const Prediction& p) { return !p.trainer_runs(); }))
    row("trainer runs it", [](const Prediction& p) {
      return p.trainer_runs() ? "yes" : "no";
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
  row("  compute beside hidden comm ms", [](const Prediction& p) {
    return ms(p.parts.comm_contention);
  });
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
  row("memory GiB/device", [](const Prediction& p) { return gib(p.memory.total()); });
  row("  params", [](const Prediction& p) { return gib(p.memory.params); });
  row("  grads", [](const Prediction& p) { return gib(p.memory.grads); });
  row("  optimizer", [](const Prediction& p) { return gib(p.memory.optimizer); });
  row("  (without ZeRO-1)",
      [](const Prediction& p) { return gib(p.memory.optimizer_without_zero); });
  row("  low-precision copies", [](const Prediction& p) { return gib(p.memory.low_precision); });
  row("  activations", [](const Prediction& p) { return gib(p.memory.activations); });
  row("  buffers", [](const Prediction& p) { return gib(p.memory.buffers); });
  row("fits", [](const Prediction& p) { return p.fits ? "yes" : "NO"; });
  return out;
}

}  // namespace moetrain::plan
