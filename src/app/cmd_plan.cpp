// `moetrain plan`: predict step time, memory and scaling of a run (plan/cost_model.h), or
// measure this machine for it (--calibrate). Runs no training.
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "app/commands.h"
#include "core/check.h"
#include "core/threads.h"
#include "plan/ablation.h"
#include "plan/calibrate.h"
#include "plan/cost_model.h"
#include "plan/load_model.h"
#include "train/run_config.h"

namespace moetrain::app {

namespace {

// "ep=1,2,4" → {1, 2, 4}.
std::vector<int64_t> parse_sweep(const std::string& spec) {
  MOETRAIN_CHECK(spec.rfind("ep=", 0) == 0, "--sweep {}: expected ep=E1,E2,... (e.g. ep=1,2,4)",
                 spec);
  std::vector<int64_t> eps;
  std::stringstream in(spec.substr(3));
  for (std::string item; std::getline(in, item, ',');) {
    std::size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MOETRAIN_CHECK(used > 0 && used == item.size() && v >= 1,
                   "--sweep {}: '{}' is not a whole number ≥ 1", spec, item);
    eps.push_back(v);
  }
  MOETRAIN_CHECK(!eps.empty(), "--sweep {}: no EP sizes", spec);
  return eps;
}

}  // namespace

Run add_plan_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "plan", "Predict step time, memory and scaling of a run on a cluster (trains nothing)");
  struct Args {
    bool calibrate = false;
    std::string out, config, cluster, profile, sweep, load = "uniform";
    std::vector<std::string> overrides;
    int64_t procs = 1, ep = 0, tp = 1, pp = 1, vp = 1, threads = 0;
    bool no_bf16 = false;
    double ablation_zipf = 1.0;
    bool json = false, ablation = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_flag("--calibrate", args->calibrate,
                "Measure this machine (GEMM, memory, attention rates) and write --out");
  cmd->add_option("--out", args->out, "Profile file --calibrate writes (TOML)");
  cmd->add_flag("--no-bf16", args->no_bf16,
                "With --calibrate: skip the bf16 GEMMs (f32 runs; half the time)");
  cmd->add_option("--threads", args->threads,
                  "OpenMP threads per process on this machine (train.threads; default cores / "
                  "processes)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  cmd->add_option("-c,--config", args->config, "The run's TOML config (as for train)");
  cmd->add_option("--set", args->overrides, "Override a config key (repeatable)");
  cmd->add_option("--cluster", args->cluster,
                  "Cluster file (TOML); default: this machine from --profile");
  cmd->add_option("--profile", args->profile, "This machine's profile (plan --calibrate)");
  cmd->add_option("--procs", args->procs, "Processes (devices) the run uses")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--ep", args->ep, "Expert-parallel size (default: the config's dist.ep)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--tp", args->tp, "Tensor-parallel size (planner only, modelled simply)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--pp", args->pp, "Pipeline stages (planner only, modelled simply)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--vp", args->vp, "Virtual pipeline stages per rank (interleaved schedule)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_flag("--ablation", args->ablation,
                "Baseline, + balancing, + communication, + gradients, all (docs/plan.md)");
  cmd->add_option("--ablation-zipf", args->ablation_zipf,
                  "Zipf exponent of the ablation's unbalanced load (default 1.0)")
      ->check(CLI::Range(0.0, 10.0));
  cmd->add_option("--sweep", args->sweep, "Predict several layouts: ep=1,2,4");
  cmd->add_option("--load", args->load, "Expert load: uniform, zipf:S or metrics:RUN_DIR");
  cmd->add_flag("--json", args->json, "Print JSON instead of the table");
  return [args] {
    if (args->calibrate) {
      MOETRAIN_CHECK(!args->out.empty(), "plan --calibrate needs --out PROFILE.toml");
      init_threads();
      const plan::Calibration cal = plan::calibrate(!args->no_bf16);
      plan::save_profile(cal.device, cal.single_thread, cal.intra_node_bandwidth,
                         cal.intra_node_latency, args->out);
      const auto& d = cal.device;
      fmt::print(
          "{}: {} threads, GEMM f32 up to {:.1f} GFLOP/s ({:.1f} at smallest side {:.0f}), bf16 "
          "up to {:.1f} GFLOP/s, norm {:.1f} GB/s, copy {:.1f} GB/s, attention {:.1f} GFLOP/s\n",
          args->out, d.threads, d.peak_flops_f32 * 1e-9, d.gemm_f32_flops.front() * 1e-9,
          d.gemm_f32_dims.front(), d.peak_flops_bf16 * 1e-9, d.norm_bandwidth * 1e-9,
          cal.copy_bandwidth * 1e-9, d.attention_flops * 1e-9);
      return 0;
    }
    MOETRAIN_CHECK(!args->config.empty(), "plan needs --config C.toml (or --calibrate)");
    MOETRAIN_CHECK(!args->cluster.empty() || !args->profile.empty(),
                   "plan needs --cluster CLUSTER.toml or --profile PROFILE.toml (this machine, "
                   "from `moetrain plan --calibrate --out PROFILE.toml`)");
    const RunConfig cfg = load_run_config(args->config, args->overrides);
    const plan::ClusterSpec cluster =
        args->cluster.empty() ? plan::local_cluster(args->profile, args->procs, args->threads)
                              : plan::load_cluster(args->cluster, args->profile);
    const plan::LoadModel load = plan::parse_load(args->load, cfg.model.n_experts);
    const int64_t cfg_ep = args->ep > 0 ? args->ep : cfg.dist.ep;
    if (args->ablation) {
      const auto rows = plan::ablation(
          cfg, cluster, {args->procs, cfg_ep, args->tp, args->pp, args->vp}, args->ablation_zipf);
      if (args->json) {
        nlohmann::json j = nlohmann::json::array();
        for (const auto& r : rows) {
          nlohmann::json row = plan::to_json(r.prediction);
          row["row"] = r.name;
          row["settings"] = r.settings;
          row["samples_per_s"] = r.prediction.tokens_per_s / static_cast<double>(cfg.train.seq_len);
          j.push_back(row);
        }
        fmt::print("{}\n", nlohmann::json{{"ablation", j}}.dump(2));
      } else {
        fmt::print("{} on {} × {} (zipf s = {} where unbalanced)\n", args->config, args->procs,
                   cluster.device.name, args->ablation_zipf);
        fmt::print("{}", plan::format_ablation(rows, cfg.train.seq_len));
      }
      return 0;
    }
    std::vector<int64_t> eps =
        args->sweep.empty() ? std::vector<int64_t>{cfg_ep} : parse_sweep(args->sweep);
    std::vector<plan::Prediction> ps;
    for (int64_t ep : eps)
      ps.push_back(
          plan::predict(cfg, cluster, {args->procs, ep, args->tp, args->pp, args->vp}, load));
    if (ps.size() == 1) plan::check_fits(ps[0], cluster);
    const plan::Prediction* best = nullptr;
    for (const auto& p : ps)
      if (p.fits && (best == nullptr || p.step_time_s < best->step_time_s)) best = &p;
    if (args->json) {
      nlohmann::json j = nlohmann::json::array();
      for (const auto& p : ps) j.push_back(plan::to_json(p));
      nlohmann::json out = ps.size() == 1 ? j[0] : nlohmann::json{{"layouts", j}};
      out["device"] = cluster.device.name;
      out["load"] = load.kind;
      if (best != nullptr) out["best_ep"] = best->layout.ep;
      fmt::print("{}\n", out.dump(2));
      return 0;
    }
    fmt::print("{} on {} × {} ({} load)\n", args->config, cluster.devices(), cluster.device.name,
               load.kind);
    fmt::print("{}", plan::format_table(ps));
    if (ps.size() > 1) {
      MOETRAIN_CHECK(best != nullptr, "no layout of --sweep {} fits the device's memory",
                     args->sweep);
      fmt::print("best: ep={} ({:.2f} ms a step)\n", best->layout.ep, best->step_time_s * 1e3);
    }
    return 0;
  };
}

}  // namespace moetrain::app
