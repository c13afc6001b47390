// `moetrain plan`: predict step time, memory and scaling of a run (plan/cost_model.h), or
// measure this machine for it (--calibrate). Runs no training.
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "app/commands.h"
#include "app/options.h"
#include "core/check.h"
#include "core/parse.h"
#include "core/threads.h"
#include "model/params.h"
#include "parallel/pipeline_trace.h"
#include "parallel/runtime.h"
#include "plan/ablation.h"
#include "plan/advise.h"
#include "plan/calibrate.h"
#include "plan/calibrate_comm.h"
#include "plan/cost_model.h"
#include "plan/load_model.h"
#include "plan/sweep.h"
#include "train/run_config.h"

namespace moetrain::app {

namespace {

// "2,4" → {2, 4}; "0" → none; "auto" → this machine's cores where the build has MPI.
std::vector<int64_t> parse_comm_procs(const std::string& spec) {
  std::vector<int64_t> out;
  if (spec == "auto") {
#if MOETRAIN_WITH_MPI
    if (hardware_cores() >= 2) out.push_back(hardware_cores());
#endif
    return out;
  }
  for (const std::string& item : split_list(spec)) {
    const std::optional<int64_t> v = parse_whole(item);
    MOETRAIN_CHECK(v && (*v == 0 || *v >= 2),
                   "--comm-procs {}: '{}' is not 0 or a whole number ≥ 2", spec, item);
    if (*v > 0) out.push_back(*v);
  }
  return out;
}

}  // namespace

Run add_plan_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "plan", "Predict step time, memory and scaling of a run on a cluster (trains nothing)");
  struct Args {
    bool calibrate = false;
    std::string out, config, cluster, profile, load = "uniform";
    std::vector<std::string> overrides, sweep, mpi_args;
    int64_t procs = 0, ep = 0, tp = 1, etp = 1, pp = 1, vp = 1, threads = 0, zero = -1;
    int64_t pp_first_layers = 0, pp_last_layers = 0;
    std::string recompute, recompute_modules, offload, pp_account;
    bool a2a_dedup = false, a2a_overlap = false;
    std::string pp_schedule, pp_trace;
    bool no_bf16 = false, calibrate_comm = false;
    std::string comm_procs = "auto";
    int64_t grad_bytes = 16 << 20, a2a_bytes = 1 << 20;
    double ablation_zipf = 1.0;
    bool json = false, ablation = false, advise = false;
    std::string sizes;
  };
  auto args = std::make_shared<Args>();
  cmd->add_flag("--calibrate", args->calibrate,
                "Measure this machine (GEMM, memory, attention rates) and write --out; with "
                "-c, also the config's kernels at its own shapes");
  cmd->add_option("--out", args->out, "Profile file --calibrate writes (TOML)");
  cmd->add_flag("--no-bf16", args->no_bf16,
                "With --calibrate: skip the bf16 GEMMs (f32 runs; half the time)");
  cmd->add_option("--comm-procs", args->comm_procs,
                  "With --calibrate: measure the collectives under mpirun with these process "
                  "counts (2,4; 0 = not at all; default auto = this machine's cores)");
  add_mpi_arg_option(cmd, args->mpi_args)
      ->description(
          "With --calibrate: an argument for the mpirun that measures the collectives, "
          "repeatable, written with '=': --mpi-arg=--allow-run-as-root");
  // Internal: what --calibrate runs under mpirun.
  cmd->add_flag("--calibrate-comm", args->calibrate_comm)->group("");
  cmd->add_option("--grad-bytes", args->grad_bytes)->group("");
  cmd->add_option("--a2a-bytes", args->a2a_bytes)->group("");
  cmd->add_option("--threads", args->threads,
                  "OpenMP threads per process on this machine (train.threads; default cores / "
                  "processes)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  cmd->add_option("-c,--config", args->config, "The run's TOML config (as for train)");
  cmd->add_option("--set", args->overrides, "Override a config key (repeatable)");
  cmd->add_option("--cluster", args->cluster,
                  "Cluster file (TOML); default: this machine from --profile");
  cmd->add_option("--profile", args->profile, "This machine's profile (plan --calibrate)");
  cmd->add_option("--procs", args->procs,
                  "Processes (devices) the run uses (default: every device of --cluster; 1 on "
                  "this machine)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--ep", args->ep, "Expert-parallel size (default: the config's dist.ep)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--tp", args->tp, "Tensor-parallel size (dist.tp: this trainer's on a CPU profile, Megatron's on an accelerator)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--etp", args->etp,
                  "Expert tensor-parallel size: each expert's hidden size split over this many "
                  "ranks, EP × ETP folded over TP × DP (dist.etp)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--pp", args->pp, "Pipeline stages (dist.pp), timed pass by pass under --pp-schedule")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--vp", args->vp, "Virtual pipeline stages per rank (interleaved and zero_bubble schedules)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--pp-schedule", args->pp_schedule,
                  "Pipeline schedule timed for the bubble: gpipe, 1f1b, interleaved, zero_bubble "
                  "(default: interleaved with --vp > 1, else 1f1b)");
  cmd->add_option("--pp-account", args->pp_account,
                  "Units that take a block's place in the pipeline's split, as Megatron-Core's "
                  "account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split: "
                  "embedding, loss, comma-separated; model.n_layers plus them must divide by "
                  "--pp × --vp (planner only)");
  cmd->add_option("--pp-first-layers", args->pp_first_layers,
                  "Blocks on the first pipeline stage, as Megatron-Core's "
                  "decoder_first_pipeline_num_layers; the stages without a count share the rest "
                  "evenly (with --vp 1, without --pp-account; planner only)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  cmd->add_option("--pp-last-layers", args->pp_last_layers,
                  "Blocks on the last pipeline stage, as Megatron-Core's "
                  "decoder_last_pipeline_num_layers (planner only)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  cmd->add_option("--zero", args->zero,
                  "ZeRO stage 0-3 for memory and time (default: the config's dist.zero)")
      ->check(CLI::Range(int64_t{0}, int64_t{3}));
  cmd->add_flag("--recompute{full}", args->recompute,
                "Activation recomputation for memory and time: --recompute (full: each layer's "
                "input kept, its forward rerun in backward) or --recompute=none|moe|full "
                "(default: the config's train.recompute)");
  cmd->add_option("--recompute-modules", args->recompute_modules,
                  "Selective recomputation on top of --recompute none or moe, as Megatron-Core's "
                  "recompute_modules: layernorm (the norms' outputs), moe_act (the experts' "
                  "activation outputs), mla_up_proj (latent attention's per-head q, k, v: the "
                  "up-projections rerun in backward), comma-separated (planner only)");
  cmd->add_flag("--offload{host_file}", args->offload,
                "Optimizer state offload for memory: --offload (host_file: moments and master "
                "weights in a host file, its disk time not timed) or --offload=none|host_file "
                "(default: the config's dist.offload)");
  cmd->add_flag("--a2a-dedup", args->a2a_dedup,
                "The expert all-to-all as DeepEP runs it: a token crosses to each node once and "
                "is fanned out over NVLink (planner only)");
  cmd->add_flag("--a2a-overlap", args->a2a_overlap,
                "Each micro-batch's expert all-to-alls run while another micro-batch computes "
                "(1F1B with all-to-all overlap; planner only)");
  cmd->add_flag("--ablation", args->ablation,
                "Baseline, + balancing, + communication, + gradients, all (docs/plan.md)");
  cmd->add_option("--ablation-zipf", args->ablation_zipf,
                  "Zipf exponent of the ablation's unbalanced load")
      ->check(CLI::Range(0.0, 10.0));
  cmd->add_flag("--advise", args->advise,
                "With --cluster: for cluster sizes from 8 devices to the file's (or --sizes), "
                "which strategies pay — static or dynamic balancing, flat or hierarchical "
                "exchange, dense or sparse expert gradients — beside the design's tiers "
                "(docs/plan.md)");
  cmd->add_option("--sizes", args->sizes,
                  "With --advise: device counts to advise on, e.g. 8,64,512,4096 (beyond the "
                  "cluster file: more nodes of its kind)");
  cmd->add_option("--sweep", args->sweep,
                  "Predict several layouts: procs=16,32,64, tp=1,2, pp=1,4, ep=1,2,4 or "
                  "a2a=flat,hierarchical (repeat to cross them)")
      ->take_all();
  auto* load_opt = cmd->add_option(
      "--load", args->load,
      "Expert load: uniform, zipf:S or metrics:RUN_DIR (default uniform; with --advise zipf:1, "
      "what static balancing leaves)");
  cmd->add_option("--pp-trace", args->pp_trace,
                  "With --pp > 1: write the step's pipeline schedule as the bubble was timed "
                  "(each stage's forward, backward and weight passes) to FILE, Chrome trace-event "
                  "JSON that Perfetto (ui.perfetto.dev) and chrome://tracing open");
  cmd->add_flag("--json", args->json, "Print JSON instead of the table");
  return [args, load_opt] {
    if (args->calibrate_comm) {
      MOETRAIN_CHECK(!args->out.empty(), "plan --calibrate-comm needs --out FILE");
      const auto world = dist_world("plan_calibrate");
      const plan::CommFigures f = plan::measure_comm(*world, args->grad_bytes, args->a2a_bytes);
      if (world->rank() == 0) plan::write_comm_figures(f, args->out);
      return 0;
    }
    if (args->calibrate) {
      MOETRAIN_CHECK(!args->out.empty(), "plan --calibrate needs --out PROFILE.toml");
      const std::vector<int64_t> comm_procs = parse_comm_procs(args->comm_procs);
      init_threads();
      // With a config: also its kernels at its own shapes (plan/kernel_table.h), and its
      // gradient and all-to-all sizes for the collectives.
      std::unique_ptr<RunConfig> cfg;
      if (!args->config.empty())
        cfg = std::make_unique<RunConfig>(load_run_config(args->config, args->overrides));
      const plan::Calibration cal = plan::calibrate(!args->no_bf16, cfg.get());
      std::vector<plan::CommFigures> comm;
      for (const int64_t P : comm_procs) {
        int64_t grad = args->grad_bytes, a2a = args->a2a_bytes;
        if (cfg) {
          const ModelConfig& m = cfg->model;
          grad = static_cast<int64_t>(4 * ParamLayout(m).size());
          a2a = cfg->train.batch_size * cfg->train.seq_len * m.top_k * m.dim * 4 * (P - 1) / P;
        }
        comm.push_back(plan::calibrate_comm(P, grad, a2a, args->mpi_args));
      }
      plan::save_profile(cal.device, cal.single_thread, cal.intra_node_bandwidth,
                         cal.intra_node_latency, comm, args->out);
      for (const auto& f : comm)
        fmt::print(
            "collectives with {} processes: latency {:.1f} µs, all-to-all {:.2f} GB/s "
            "(+{:.0f} µs when the peers arrive late; bound by the busiest receiver: "
            "{:.2f}), all-reduce {:.2f} GB/s, reduction over a group of one {:.2f} GB/s\n",
            f.procs, f.latency * 1e6, f.alltoall_bandwidth * 1e-9, f.late_penalty * 1e6,
            f.receiver_bound, f.allreduce_bandwidth * 1e-9, f.self_reduce_bandwidth * 1e-9);
      const auto& d = cal.device;
      fmt::print(
          "{}: {} threads, GEMM f32 up to {:.1f} GFLOP/s ({:.1f} at smallest side {:.0f}), bf16 "
          "up to {:.1f} GFLOP/s, norm {:.1f} GB/s, copy {:.1f} GB/s, attention {:.1f} GFLOP/s\n",
          args->out, d.threads, d.peak_flops_f32 * 1e-9, d.gemm_f32_flops.front() * 1e-9,
          d.gemm_f32_dims.front(), d.peak_flops_bf16 * 1e-9, d.norm_bandwidth * 1e-9,
          cal.copy_bandwidth * 1e-9, d.attention_flops * 1e-9);
      return 0;
    }
    MOETRAIN_CHECK(!args->advise || !args->cluster.empty(),
                   "plan --advise needs --cluster CLUSTER.toml: the sizes it advises on are "
                   "nodes of that cluster's kind");
    MOETRAIN_CHECK(args->sizes.empty() || args->advise, "--sizes is for plan --advise");
    MOETRAIN_CHECK(!args->advise || (!args->ablation && args->sweep.empty() && args->procs == 0),
                   "plan --advise chooses its own sizes (--sizes): it does not take --ablation, "
                   "--sweep or --procs");
    MOETRAIN_CHECK(!args->config.empty(), "plan needs --config C.toml (or --calibrate)");
    MOETRAIN_CHECK(args->pp_trace.empty() || (args->pp > 1 && args->sweep.empty() &&
                                              !args->ablation && !args->advise),
                   "plan --pp-trace {}: writes the pipeline of one layout, so it needs --pp > 1 "
                   "(given {}) and no --sweep, --ablation or --advise",
                   args->pp_trace, args->pp);
    MOETRAIN_CHECK(!args->cluster.empty() || !args->profile.empty(),
                   "plan needs --cluster CLUSTER.toml or --profile PROFILE.toml (this machine, "
                   "from `moetrain plan --calibrate --out PROFILE.toml`)");
    const RunConfig cfg = load_run_config(args->config, args->overrides);
    // A cluster file describes the devices once; this machine's depends on the process count
    // (the processes split its cores).
    std::optional<plan::ClusterSpec> file_cluster;
    if (!args->cluster.empty()) file_cluster = plan::load_cluster(args->cluster, args->profile);
    auto cluster_for = [&](int64_t procs) {
      return file_cluster ? *file_cluster
                          : plan::local_cluster(args->profile, procs, args->threads);
    };
    const int64_t procs = args->procs > 0 ? args->procs
                          : file_cluster  ? file_cluster->devices()
                                          : 1;
    // --advise: what static balancing leaves, Zipf(1) unless --load says otherwise.
    const std::string load_spec = args->advise && load_opt->count() == 0 ? "zipf:1" : args->load;
    const plan::LoadModel load = plan::parse_load(load_spec, cfg.model.n_experts);
    const int64_t cfg_ep = args->ep > 0 ? args->ep : cfg.dist.ep;
    plan::Layout layout{procs, cfg_ep, args->tp, args->pp, args->vp};
    layout.etp = args->etp;
    layout.zero = args->zero;
    if (!args->recompute.empty()) layout.recompute = parse_recompute(args->recompute);
    layout.recompute_modules = plan::parse_recompute_modules(args->recompute_modules);
    plan::parse_pp_account(layout, args->pp_account);
    layout.pp_first_layers = args->pp_first_layers;
    layout.pp_last_layers = args->pp_last_layers;
    if (!args->offload.empty()) {
      MOETRAIN_CHECK(args->offload == "none" || args->offload == "host_file",
                     "--offload={}: allowed are none and host_file", args->offload);
      layout.offload = args->offload == "host_file";
    }
    layout.a2a_dedup = args->a2a_dedup;
    layout.a2a_overlap = args->a2a_overlap;
    if (!args->pp_schedule.empty())
      layout.schedule = parse_pipe_schedule(args->pp_schedule, "--pp-schedule");
    if (args->advise) {
      const std::vector<int64_t> sizes = args->sizes.empty()
                                             ? plan::default_advice_sizes(*file_cluster)
                                             : plan::parse_advice_sizes(args->sizes);
      const auto rows = plan::advise(cfg, *file_cluster, layout, sizes, load);
      if (args->json) {
        fmt::print("{}\n", nlohmann::json{{"advice", plan::advice_json(rows)},
                                          {"device", file_cluster->device.name},
                                          {"load", load.kind}}
                               .dump(2));
      } else {
        fmt::print("{} on {} ({} load where balancing is static)\n", args->config,
                   file_cluster->device.name, load_spec);
        fmt::print("{}", plan::format_advice(rows));
      }
      return 0;
    }
    if (args->ablation) {
      const plan::ClusterSpec cluster = cluster_for(procs);
      const auto rows = plan::ablation(cfg, cluster, layout, args->ablation_zipf);
      if (args->json) {
        fmt::print("{}\n",
                   nlohmann::json{{"ablation", plan::ablation_json(rows, cfg.train.seq_len)}}.dump(2));
      } else {
        fmt::print("{} on {} × {} (zipf s = {} where unbalanced)\n", args->config, procs,
                   cluster.device.name, args->ablation_zipf);
        fmt::print("{}", plan::format_ablation(rows, cfg.train.seq_len));
      }
      return 0;
    }
    if (args->sweep.empty()) {
      const plan::ClusterSpec cluster = cluster_for(procs);
      const plan::Prediction p =
          plan::predict(cfg, cluster, layout, load);
      // The figures first, fitting or not: they are what a user shrinks the run by.
      if (args->json) {
        nlohmann::json out = plan::to_json(p);
        out["device"] = cluster.device.name;
        out["load"] = load.kind;
        fmt::print("{}\n", out.dump(2));
      } else {
        fmt::print("{} on {} × {} ({} load)\n", args->config, procs, cluster.device.name,
                   load.kind);
        fmt::print("{}", plan::format_table({p}));
        fmt::print("\n{}", plan::format_comm(p));
      }
      std::fflush(stdout);
      if (!args->pp_trace.empty()) {
        const PipeShape shape{layout.pp, cfg.train.grad_accum, layout.vp};
        write_trace(args->pp_trace,
                    pipeline_trace(p.pipe_timeline, shape,
                                   fmt::format("moetrain plan: {}, {} stages{}, {} micro-batches",
                                               pipe_schedule_name(layout.pipe_schedule()),
                                               layout.pp,
                                               layout.vp > 1
                                                   ? fmt::format(" × {} chunks", layout.vp)
                                                   : "",
                                               cfg.train.grad_accum)));
        if (!args->json) fmt::print("pipeline trace: {}\n", args->pp_trace);
      }
      plan::check_fits(p, cluster);
      return 0;
    }
    // A sweep: every layout that can run is predicted; one that cannot (does not divide, more
    // processes than devices) is listed with the reason (plan/sweep.h).
    const plan::Sweep sweep = plan::parse_sweep(args->sweep, layout, cfg.dist.hierarchical);
    const plan::SweepResult r = plan::run_sweep(cfg, cluster_for, sweep, layout, load);
    // Nothing fits anywhere: the error names what the smallest layout needs (after the table,
    // which shows every layout's memory).
    auto none_fits = [&] {
      if (!r.best.empty()) return;
      size_t least = 0;
      for (size_t i = 1; i < r.predictions.size(); ++i)
        if (r.predictions[i].memory.total() < r.predictions[least].memory.total()) least = i;
      plan::check_fits(r.predictions[least], cluster_for(r.points[least].layout.procs));
    };
    if (args->json) {
      nlohmann::json out = plan::sweep_json(sweep, r);
      out["device"] = r.device;
      out["load"] = load.kind;
      fmt::print("{}\n", out.dump(2));
    } else {
      fmt::print("{} on {} ({} load)\n", args->config, r.device, load.kind);
      fmt::print("{}", plan::format_sweep(sweep, r));
    }
    std::fflush(stdout);
    none_fits();
    return 0;
  };
}

}  // namespace moetrain::app
