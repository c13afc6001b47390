#include "plan/layout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/parse.h"
#include "plan/cost_model.h"

namespace moetrain::plan {

namespace {

// A flag's comma list of names, each turning one option on (the option lists of
// --recompute-modules and --pp-account): an unknown name is refused naming the list's `kind` and
// the names allowed; flags_name writes the options that are on back as such a list.
struct NamedFlag {
  const char* name;
  bool* on;
};

void parse_flags(const std::string& list, const char* flag, const char* kind,
                 std::initializer_list<NamedFlag> flags) {
  for (const NamedFlag& f : flags) *f.on = false;
  for (const std::string& item : split_list(list)) {
    const auto it = std::find_if(flags.begin(), flags.end(),
                                 [&](const NamedFlag& f) { return item == f.name; });
    if (it == flags.end()) {
      std::vector<std::string> allowed;
      for (const NamedFlag& f : flags) allowed.emplace_back(f.name);
      MOETRAIN_FAIL("{} {}: '{}' is not a {}; allowed are {}", flag, list, item, kind,
                    fmt::join(allowed, ", "));
    }
    *it->on = true;
  }
}

std::string flags_name(std::initializer_list<std::pair<const char*, bool>> flags) {
  std::vector<std::string> on;
  for (const auto& [name, set] : flags)
    if (set) on.emplace_back(name);
  return fmt::format("{}", fmt::join(on, ","));
}

}  // namespace

RunConfig trainer_config(const RunConfig& cfg, const Layout& l) {
  RunConfig rc = cfg;
  rc.dist.ep = l.ep, rc.dist.etp = l.etp, rc.dist.tp = l.tp, rc.dist.pp = l.pp, rc.dist.vp = l.vp;
  if (l.pp > 1) rc.dist.pp_schedule = std::string(pipe_schedule_name(l.pipe_schedule()));
  rc.dist.zero = zero_stage(cfg, l);
  rc.train.recompute = recompute_mode(cfg, l);
  if (l.offload) rc.dist.offload = *l.offload ? "host_file" : "none";
  return rc;
}

std::string planner_only(const RunConfig& cfg, const Layout& l) {
  std::vector<std::string> lacks;
  if (l.a2a_dedup) lacks.push_back("deduplicated (DeepEP) all-to-all");
  if (l.a2a_overlap) lacks.push_back("all-to-all overlapped with another micro-batch");
  if (l.recompute_modules.any())
    lacks.push_back("selective recomputation (" + recompute_modules_name(l.recompute_modules) +
                    ")");
  if (l.pp_uneven()) lacks.push_back("uneven pipeline split (--pp-first-layers, --pp-last-layers)");
  if (!lacks.empty()) {
    std::string list;
    for (size_t i = 0; i < lacks.size(); ++i)
      list += (i == 0 ? "" : i + 1 == lacks.size() ? " or " : ", ") + lacks[i];
    return "planner only: moetrain train has no " + list + " yet";
  }
  const RunConfig rc = trainer_config(cfg, l);
  try {
    rc.model.check_trainable();
    // Everything load_run_config checks but the offload directory, which validate_offload
    // creates and probes: the planner writes nothing. What offload refuses of the other keys
    // (tensor parallelism's, the pipeline's) is checked with it on; its device check comes before
    // any file is touched.
    RunConfig in_memory = rc;
    in_memory.dist.offload = "none";
    in_memory.validate();
    if (rc.dist.offloaded()) {
      validate_pipeline(rc);
      validate_tensor_parallel(rc);
      validate_expert_tensor_parallel(rc);
      if (rc.train.device != "cpu") rc.dist.validate_offload(rc.train.run_dir, rc.train.device);
    }
  } catch (const Error& e) {
    return fmt::format("planner only: {}", e.what());
  }
  return {};
}

RecomputeModules parse_recompute_modules(const std::string& list, const char* flag) {
  RecomputeModules m;
  parse_flags(list, flag, "module",
              {{"layernorm", &m.layernorm}, {"moe_act", &m.moe_act}, {"mla_up_proj", &m.mla_up_proj}});
  return m;
}

namespace {
// Blocks of the first, a middle and the last stage under pp_first_layers / pp_last_layers.
struct UnevenSplit {
  int64_t first, middle, last;
};
UnevenSplit uneven_split(const Layout& layout, int64_t n_layers) {
  const int64_t set = (layout.pp_first_layers > 0 ? 1 : 0) + (layout.pp_last_layers > 0 ? 1 : 0);
  const int64_t rest_stages = layout.pp - set;
  const int64_t rest = n_layers - layout.pp_first_layers - layout.pp_last_layers;
  const int64_t middle = rest_stages > 0 ? rest / rest_stages : 0;
  return {layout.pp_first_layers > 0 ? layout.pp_first_layers : middle, middle,
          layout.pp_last_layers > 0 ? layout.pp_last_layers : middle};
}
}  // namespace

std::string pp_split_name(const Layout& layout, int64_t n_layers) {
  if (!layout.pp_uneven()) return {};
  const UnevenSplit u = uneven_split(layout, n_layers);
  return layout.pp > 2 ? fmt::format("{}/{}/{}", u.first, u.middle, u.last)
                       : fmt::format("{}/{}", u.first, u.last);
}

PacingStage pacing_stage(const Layout& layout, int64_t n_layers, double block, double head) {
  const double L = static_cast<double>(n_layers);
  if (layout.pp_uneven()) {
    const UnevenSplit u = uneven_split(layout, n_layers);
    const double first = static_cast<double>(u.first), last = static_cast<double>(u.last);
    const double other = std::max(first, layout.pp > 2 ? static_cast<double>(u.middle) : 0.0);
    if (last * block + head >= other * block) return {last / L, true};
    return {other / L, false};
  }
  if (!layout.pp_embedding_unit && !layout.pp_loss_unit)
    return {1.0 / static_cast<double>(layout.pp), true};
  const double U = static_cast<double>(layout.pp_units(n_layers)) / layout.pp;
  const double first = U - (layout.pp_embedding_unit ? 1 : 0);
  const double last = U - (layout.pp_loss_unit ? 1 : 0);
  const double other = std::max(first, layout.pp > 2 ? U : 0.0);
  if (last * block + head >= other * block) return {last / L, true};
  return {other / L, false};
}

void parse_pp_account(Layout& layout, const std::string& list, const char* flag) {
  parse_flags(list, flag, "unit",
              {{"embedding", &layout.pp_embedding_unit}, {"loss", &layout.pp_loss_unit}});
}

std::string pp_account_name(const Layout& layout) {
  return flags_name({{"embedding", layout.pp_embedding_unit}, {"loss", layout.pp_loss_unit}});
}

std::string recompute_modules_name(const RecomputeModules& m) {
  return flags_name(
      {{"layernorm", m.layernorm}, {"moe_act", m.moe_act}, {"mla_up_proj", m.mla_up_proj}});
}

std::string layout_problem(const RunConfig& cfg, const ClusterSpec& cluster, const Layout& layout) {
  const ModelConfig& m = cfg.model;
  if (layout.procs < 1 || layout.ep < 1)
    return fmt::format("--procs {} --ep {}: both must be ≥ 1", layout.procs, layout.ep);
  if (layout.tp < 1 || layout.pp < 1 || layout.vp < 1)
    return fmt::format("--tp {} --pp {} --vp {}: each must be ≥ 1", layout.tp, layout.pp,
                       layout.vp);
  if (layout.etp < 1) return fmt::format("--etp {}: it must be ≥ 1", layout.etp);
  if (layout.zero > 3)
    return fmt::format("--zero {}: allowed are 0, 1, 2 and 3", layout.zero);
  if (layout.procs % (layout.tp * layout.pp) != 0)
    return fmt::format("--tp {} × --pp {} must divide the processes ({})", layout.tp, layout.pp,
                       layout.procs);
  // The experts fold EP × ETP over a stage's TP × DP ranks.
  if ((layout.procs / layout.pp) % (layout.ep * layout.etp) != 0)
    return fmt::format(
        "dist.ep = {}{} must divide the processes ({}): EP × ETP × EDP = TP × DP", layout.ep,
        layout.etp > 1 ? fmt::format(" × --etp {}", layout.etp) : std::string(),
        layout.pp == 1 ? fmt::format("{}", layout.procs)
                       : fmt::format("{} per pipeline stage", layout.procs / layout.pp));
  const bool units = layout.pp_embedding_unit || layout.pp_loss_unit;
  if (layout.pp_first_layers < 0 || layout.pp_last_layers < 0)
    return fmt::format("--pp-first-layers {} --pp-last-layers {}: each must be ≥ 0 (0: not set)",
                       layout.pp_first_layers, layout.pp_last_layers);
  if (layout.pp_uneven()) {
    if (layout.pp == 1 || layout.vp > 1 || units)
      return fmt::format("--pp-first-layers / --pp-last-layers need --pp > 1, --vp 1 and no "
                         "--pp-account (got --pp {} --vp {}{})",
                         layout.pp, layout.vp, units ? " --pp-account " + pp_account_name(layout)
                                                     : std::string());
    const int64_t set = (layout.pp_first_layers > 0 ? 1 : 0) + (layout.pp_last_layers > 0 ? 1 : 0);
    const int64_t rest = m.n_layers - layout.pp_first_layers - layout.pp_last_layers;
    const int64_t rest_stages = layout.pp - set;
    if (rest_stages == 0 ? rest != 0 : rest < rest_stages || rest % rest_stages != 0)
      return fmt::format(
          "--pp-first-layers {} --pp-last-layers {}: the other {} of model.n_layers = {} must be "
          "shared evenly by the other {} stage{} of --pp {}, at least one block each",
          layout.pp_first_layers, layout.pp_last_layers, rest, m.n_layers, rest_stages,
          rest_stages == 1 ? "" : "s", layout.pp);
  }
  if (units && layout.pp == 1)
    return "--pp-account: the embedding and the loss take a block's place in a pipeline's split "
           "only with --pp > 1";
  if (!layout.pp_uneven() && layout.pp_units(m.n_layers) % (layout.pp * layout.vp) != 0)
    return units ? fmt::format("model.n_layers = {} and the {} unit{} of --pp-account ({}) must "
                               "be divisible by --pp {} × --vp {}",
                               m.n_layers, layout.pp_units(m.n_layers) - m.n_layers,
                               layout.pp_units(m.n_layers) - m.n_layers > 1 ? "s" : "",
                               layout.pp_units(m.n_layers), layout.pp, layout.vp)
                 : fmt::format("model.n_layers = {} must be divisible by --pp {} × --vp {}",
                               m.n_layers, layout.pp, layout.vp);
  if (units && layout.pp_units(m.n_layers) / layout.pp < 2)
    return fmt::format("--pp-account with --pp {}: a stage of the embedding or the loss alone "
                       "(model.n_layers = {} leaves it no block)",
                       layout.pp, m.n_layers);
  // Multi-head latent attention has a key and a value per head: model.n_kv_heads is not used.
  if (m.n_heads % layout.tp != 0 || (!m.mla() && m.n_kv_heads % layout.tp != 0))
    return fmt::format("--tp {} must divide model.n_heads = {} and model.n_kv_heads = {}",
                       layout.tp, m.n_heads, m.n_kv_heads);
  if (layout.etp > 1 && (m.n_moe_layers() == 0 || m.expert_hidden % layout.etp != 0))
    return m.n_moe_layers() == 0
               ? fmt::format("--etp {}: the model has no MoE layer whose experts it could split",
                             layout.etp)
               : fmt::format("--etp {} must divide model.expert_hidden = {}", layout.etp,
                             m.expert_hidden);
  if (m.n_experts % layout.ep != 0)
    return fmt::format("dist.ep = {} must divide model.n_experts = {}", layout.ep, m.n_experts);
  if (layout.recompute_modules.mla_up_proj && !m.mla())
    return "--recompute-modules mla_up_proj: the model has no multi-head latent attention "
           "(model.kv_lora_rank = 0)";
  if (layout.recompute_modules.any()) {
    // Full keeps only each block's input: nothing is left to select. MoE recomputation already
    // drops the experts' intermediates, their activation outputs among them.
    const Recompute r = recompute_mode(cfg, layout);
    if (r == Recompute::Full || (r == Recompute::Moe && layout.recompute_modules.moe_act))
      return fmt::format(
          "--recompute-modules {} with recomputation {}: {}",
          recompute_modules_name(layout.recompute_modules), recompute_name(r),
          r == Recompute::Full
              ? "full already recomputes every block from its input (allowed with none or moe)"
              : "moe already recomputes the experts' activations (moe_act is for none)");
  }
  if (layout.pp > 1) {
    const std::string problem =
        pipe_shape_problem(layout.pipe_schedule(), {layout.pp, cfg.train.grad_accum, layout.vp});
    if (!problem.empty()) return problem;
  }
  if (layout.procs > cluster.devices())
    return fmt::format(
        "{} processes but the cluster has {} devices (devices_per_node {} × nodes {})",
        layout.procs, cluster.devices(), cluster.devices_per_node, cluster.nodes);
  return {};
}

}  // namespace moetrain::plan
