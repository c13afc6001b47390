// `moetrain train` and `moetrain eval`.
#include <fmt/format.h>

#include <filesystem>
#include <memory>

#include "app/commands.h"
#include "app/options.h"
#include "core/threads.h"
#include "data/shard.h"
#include "parallel/runtime.h"
#include "parallel/watchdog.h"
#include "train/evaluate.h"
#include "train/run_config.h"
#include "train/trainer.h"

namespace moetrain::app {

namespace {

using Kind = ConfigFlag::Kind;

// train's options that set configuration keys.
const std::vector<ConfigFlag>& train_config_flags() {
  static const std::vector<ConfigFlag> flags = {
      {.name = "--ep",
       .kind = Kind::Int,
       .key = "dist.ep",
       .help = "Expert-parallel group size under mpirun (same as --set dist.ep=E): world = DP x EP",
       .check = CLI::PositiveNumber},
      {.name = "--zero",
       .kind = Kind::Int,
       .key = "dist.zero",
       .help = "1: ZeRO-1 optimizer-state sharding under mpirun (dist.zero)",
       .check = CLI::Range(0, 1)},
      {.name = "--hierarchical",
       .kind = Kind::Switch,
       .key = "dist.hierarchical",
       .help = "Two-stage expert all-to-all: within nodes, then between them (dist.hierarchical)",
       .value = "true"},
      {.name = "--ranks-per-node",
       .kind = Kind::Int,
       .key = "dist.ranks_per_node",
       .help = "With the two-stage all-to-all: ranks per node, overriding detection (emulates "
               "nodes); implies --hierarchical",
       .implies = "dist.hierarchical=true",
       .check = CLI::NonNegativeNumber},
      {.name = "--a2a-chunks",
       .kind = Kind::Int,
       .key = "dist.a2a_chunks",
       .help = "Split each MoE all-to-all into n chunks overlapped with expert compute "
               "(dist.a2a_chunks)",
       .check = CLI::Range(1, 64)},
      {.name = "--no-overlap",
       .kind = Kind::Switch,
       .key = "dist.overlap",
       .help = "Reduce gradients after backward instead of during it (dist.overlap = false)",
       .value = "false"},
      {.name = "--collective-warn",
       .kind = Kind::Number,
       .key = "dist.collective_warn",
       .help = "Under mpirun: warn when a collective has waited this many seconds "
               "(dist.collective_warn, default 60; 0 = off)",
       .check = CLI::NonNegativeNumber},
      {.name = "--collective-timeout",
       .kind = Kind::Number,
       .key = "dist.collective_timeout",
       .help = "Under mpirun: abort the job when a collective has waited this many seconds, "
               "naming it, so that `moetrain launch` restarts it (dist.collective_timeout, "
               "default 300; 0 = off)",
       .check = CLI::NonNegativeNumber},
      {.name = "--debug-collectives",
       .kind = Kind::Switch,
       .key = "dist.debug_collectives",
       .help = "Under mpirun: ranks compare every collective's fingerprint (sequence, kind, "
               "element size, counts) before running it; a mismatch fails at once "
               "(dist.debug_collectives)",
       .value = "true"},
      // Checked with the rest of the configuration, which names the key and the allowed values.
      {.name = "--precision",
       .kind = Kind::Text,
       .key = "train.precision",
       .help = "GEMM operand precision: f32, bf16, or fp16 with dynamic loss scaling "
               "(train.precision)"},
      {.name = "--grad-reduce-dtype",
       .kind = Kind::Text,
       .key = "dist.grad_reduce_dtype",
       .help =
           "Data-parallel gradient reduction on the wire: f32 or bf16 (dist.grad_reduce_dtype)"},
      {.name = "--a2a-dtype",
       .kind = Kind::Text,
       .key = "dist.a2a_dtype",
       .help = "Expert all-to-all payloads on the wire: f32 or bf16 (dist.a2a_dtype)"},
  };
  return flags;
}

}  // namespace

Run add_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Train a model from a TOML config");
  struct Args {
    std::string config;
    std::vector<std::string> overrides;
    bool resume = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("-c,--config", args->config, "TOML config file (e.g. configs/tiny.toml)")
      ->required();
  cmd->add_option("--set", args->overrides,
                  "Override a config key: --set model.dim=256 (repeatable)");
  cmd->add_flag("--resume", args->resume,
                "Continue from the run directory's latest complete checkpoint");
  auto flags = add_config_flags(cmd, train_config_flags());
  return [args, flags] {
    const std::vector<std::string> overrides = flags->apply(args->overrides);
    RunConfig cfg = load_run_config(args->config, overrides);
    // Collectives exist only under mpirun; the watchdog watches them for the whole run.
    std::unique_ptr<CollectiveWatchdog> watchdog;
    if (dist_mpi_active()) {
      set_debug_collectives(cfg.dist.debug_collectives);
      watchdog = std::make_unique<CollectiveWatchdog>(
          WatchdogSettings{cfg.dist.collective_warn, cfg.dist.collective_timeout});
    }
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
