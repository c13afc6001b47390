// `moetrain train` and `moetrain eval`.
#include <fmt/format.h>

#include <filesystem>
#include <memory>

#include "app/commands.h"
#include "app/dist_options.h"
#include "core/threads.h"
#include "data/shard.h"
#include "train/evaluate.h"
#include "train/run_config.h"
#include "train/trainer.h"

namespace moetrain::app {

Run add_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Train a model from a TOML config");
  struct Args {
    std::string config;
    std::vector<std::string> overrides;
    bool resume = false;
    DistOptions dist;
    int64_t ranks_per_node = -1, a2a_chunks = 0;
    bool hierarchical = false, no_overlap = false;
    double collective_warn = -1, collective_timeout = -1;
    bool debug_collectives = false;
    std::string precision, grad_reduce_dtype, a2a_dtype;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("-c,--config", args->config, "TOML config file (e.g. configs/tiny.toml)")
      ->required();
  cmd->add_option("--set", args->overrides,
                  "Override a config key: --set model.dim=256 (repeatable)");
  cmd->add_flag("--resume", args->resume,
                "Continue from the run directory's latest complete checkpoint");
  add_dist_options(cmd, args->dist);
  cmd->add_flag("--hierarchical", args->hierarchical,
                "Two-stage expert all-to-all: within nodes, then between them (dist.hierarchical)");
  cmd->add_option("--ranks-per-node", args->ranks_per_node,
                  "With the two-stage all-to-all: ranks per node, overriding detection (emulates "
                  "nodes); implies "
                  "--hierarchical")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option(
         "--a2a-chunks", args->a2a_chunks,
         "Split each MoE all-to-all into n chunks overlapped with expert compute (dist.a2a_chunks)")
      ->check(CLI::Range(1, 64));
  cmd->add_flag("--no-overlap", args->no_overlap,
                "Reduce gradients after backward instead of during it (dist.overlap = false)");
  cmd->add_option("--collective-warn", args->collective_warn,
                  "Under mpirun: warn when a collective has waited this many seconds "
                  "(dist.collective_warn, default 60; 0 = off)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--collective-timeout", args->collective_timeout,
                  "Under mpirun: abort the job when a collective has waited this many seconds, "
                  "naming it, so that `moetrain launch` restarts it (dist.collective_timeout, "
                  "default 300; 0 = off)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--debug-collectives", args->debug_collectives,
                "Under mpirun: ranks compare every collective's fingerprint (sequence, kind, "
                "element size, counts) before running it; a mismatch fails at once "
                "(dist.debug_collectives)");
  cmd->add_option("--precision", args->precision,
                  "GEMM operand precision: f32, bf16, or fp16 with dynamic loss scaling "
                  "(train.precision)");
  cmd->add_option(
      "--grad-reduce-dtype", args->grad_reduce_dtype,
      "Data-parallel gradient reduction on the wire: f32 or bf16 (dist.grad_reduce_dtype)");
  cmd->add_option("--a2a-dtype", args->a2a_dtype,
                  "Expert all-to-all payloads on the wire: f32 or bf16 (dist.a2a_dtype)");
  return [args] {
    std::vector<std::string> overrides = args->overrides;
    if (args->collective_warn >= 0)
      overrides.push_back(fmt::format("dist.collective_warn={}", args->collective_warn));
    if (args->collective_timeout >= 0)
      overrides.push_back(fmt::format("dist.collective_timeout={}", args->collective_timeout));
    if (args->debug_collectives) overrides.push_back("dist.debug_collectives=true");
    // Checked with the rest of the configuration, which names the key and the allowed values.
    if (!args->precision.empty()) overrides.push_back("train.precision=" + args->precision);
    if (!args->grad_reduce_dtype.empty())
      overrides.push_back("dist.grad_reduce_dtype=" + args->grad_reduce_dtype);
    if (!args->a2a_dtype.empty()) overrides.push_back("dist.a2a_dtype=" + args->a2a_dtype);
    if (args->no_overlap) overrides.push_back("dist.overlap=false");
    if (args->a2a_chunks > 0)
      overrides.push_back(fmt::format("dist.a2a_chunks={}", args->a2a_chunks));
    append_dist_overrides(args->dist, overrides);
    if (args->hierarchical || args->ranks_per_node >= 0)
      overrides.push_back("dist.hierarchical=true");
    if (args->ranks_per_node >= 0)
      overrides.push_back(fmt::format("dist.ranks_per_node={}", args->ranks_per_node));
    RunConfig cfg = load_run_config(args->config, overrides);
    const std::unique_ptr<CollectiveWatchdog> watchdog = watch_collectives(cfg.dist);
    Trainer trainer(cfg, args->resume);
    TrainResult r = trainer.run();
    if (trainer.rank() != 0) return 0;  // one summary for the whole run
    fmt::print(
        "steps {} | final train loss {:.4f} | validation loss {:.4f} nats/byte | {:.0f} tokens/s | "
        "{:.1f} s\n",
        r.steps_done, r.final_loss, r.val_loss, r.tokens_per_s, r.seconds);
    fmt::print("checkpoint: {}\n", r.last_checkpoint.string());
    return 0;
  };
}

Run add_eval_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("eval", "Validation loss of a checkpoint");
  struct Args {
    std::string checkpoint, data;
    int64_t batches = 0;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--checkpoint", args->checkpoint, "Checkpoint directory or run directory")
      ->required();
  cmd->add_option("--data", args->data, "Directory with val.bin (default: the run's data.dir)");
  cmd->add_option("--batches", args->batches,
                  "Batches to evaluate (default: the run's train.eval_batches)")
      ->check(CLI::NonNegativeNumber);
  return [args] {
    init_threads();
    LoadedModel m = load_model(args->checkpoint);
    std::filesystem::path dir = args->data.empty() ? m.config.data.dir : args->data;
    TokenShard val(dir / "val.bin");
    int64_t batches = args->batches > 0 ? args->batches : m.config.train.eval_batches;
    double loss = evaluate(*m.model, m.params.data(), val, m.config.train.batch_size,
                           m.config.train.seq_len, batches);
    fmt::print("step {} | validation loss {:.4f} nats/token over {} batches of {}x{}\n", m.step,
               loss, batches, m.config.train.batch_size, m.config.train.seq_len);
    return 0;
  };
}

}  // namespace moetrain::app
