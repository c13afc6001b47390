// `moetrain train` and `moetrain eval`.
#include <fmt/format.h>

#include <filesystem>
#include <memory>

#include <nlohmann/json.hpp>

#include "app/checks.h"
#include "app/commands.h"
#include "app/dist_options.h"
#include "core/resident.h"
#include "core/threads.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "parallel/runtime.h"
#include "train/evaluate.h"
#include "train/memory_estimate.h"
#include "train/run_config.h"
#include "train/trainer.h"

namespace moetrain::app {

using Kind = ConfigFlag::Kind;

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// The dry run's memory table: what each of `np` ranks (0: the run's processes) would hold, the
// memory this machine has and whether the ranks on it fit.
void print_memory_table(const RunConfig& cfg, int np) {
  const bool mpi = dist_mpi_active();
  const int world = np > 0 ? np : mpi ? dist_world("dry-run")->size() : 1;
  const int here = np > 0 && !mpi ? np : mpi ? dist_local_size() : 1;
  // This process as the binary and its libraries leave it: the baseline the trainer measures.
  const MemoryEstimate e = rank_memory(cfg.model, cfg.train.batch_size, cfg.train.seq_len,
                                       trainer_layout(cfg, world, resident_memory().rss));
  if (mpi && dist_world("dry-run rank")->rank() != 0) return;
  fmt::print("memory per rank ({} process{}{}{}, dist.ep = {}, dist.zero = {}, train.precision = "
             "{}):\n{}",
             world, world > 1 ? "es" : "",
             cfg.dist.tp > 1 ? fmt::format(", dist.tp = {}{}", cfg.dist.tp,
                                           cfg.dist.sequence_parallel ? " (sequence-parallel)" : "")
                             : std::string(),
             cfg.dist.pp > 1 ? fmt::format(", dist.pp = {} ({}{})", cfg.dist.pp,
                                           cfg.dist.pp_schedule,
                                           cfg.dist.vp > 1
                                               ? fmt::format(", dist.vp = {}", cfg.dist.vp)
                                               : std::string())
                             : std::string(),
             world > 1 ? cfg.dist.ep : 1, cfg.dist.zero, precision_name(cfg.train.precision),
             e.table());
  std::string source;
  const double avail = available_memory(&source);
  if (avail < 0) {
    fmt::print("available: unknown (neither /proc/meminfo nor a memory cgroup could be read)\n");
    return;
  }
  const double need = e.total() * here;
  fmt::print("available: {:.1f} MiB ({}) for {} rank{} on this machine: {}\n", avail / kMiB,
             source, here, here > 1 ? "s" : "",
             need <= avail ? "fits" : fmt::format("does not fit ({:.1f} MiB needed)", need / kMiB));
}

}  // namespace

const std::vector<ConfigFlag>& train_config_flags() {
  static const std::vector<ConfigFlag> flags = [] {
    std::vector<ConfigFlag> f = run_config_flags();
    const std::vector<ConfigFlag>& dist = dist_config_flags();
    f.insert(f.end(), dist.begin(), dist.end());
    // Checked with the rest of the configuration, which names the key and the allowed values.
    f.push_back({.name = "--precision",
                 .kind = Kind::Text,
                 .key = "train.precision",
                 .help = "GEMM operand precision: f32, bf16, fp16 with dynamic loss scaling, tf32 "
                         "(with --device cuda: the tensor cores' TF32 operands), or "
                         "auto (bf16 where oneDNN has a native bf16 matmul or with --device "
                         "cuda, else f32; recorded, and kept on resume) (train.precision)"});
    f.push_back({.name = "--device",
                 .kind = Kind::Text,
                 .key = "train.device",
                 .help = "Where the forward and backward run: cpu, or cuda (one GPU; a build with "
                         "the CUDA backend) (train.device)"});
    return f;
  }();
  return flags;
}

Run add_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Train a model from a TOML config");
  struct Args {
    std::string config;
    std::vector<std::string> overrides;
    std::string init_from;
    bool resume = false;
    bool dry_run = false;
    bool all = false;
    int np = 0;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("-c,--config", args->config, "TOML config file (e.g. configs/tiny.toml)")
      ->required();
  cmd->add_option("--set", args->overrides,
                  "Override a config key: --set model.dim=256 (repeatable)");
  cmd->add_flag("--resume", args->resume,
                "Continue from the run directory's latest complete checkpoint");
  cmd->add_option("--init-from", args->init_from,
                  "Start from these weights (a checkpoint, run or Hugging Face Mixtral directory) "
                  "at step 0 with fresh optimizer state; the model takes its architecture");
  CLI::Option* dry_run = cmd->add_flag("--dry-run", args->dry_run,
                "Validate the configuration (file, --set and flags), print the settings that "
                "differ from the defaults as JSON and exit; trains nothing, reads no data");
  cmd->add_flag("--all", args->all, "With --dry-run: print every setting, not only the changed")
      ->needs(dry_run);
  cmd->add_option("--np", args->np,
                  "With --dry-run: the processes whose layout (dist.ep, dist.zero) the memory "
                  "table is for (default: the run's, 1 without mpirun)")
      ->check(integer_in(1))
      ->needs(dry_run);
  auto flags = add_config_flags(cmd, train_config_flags());
  return [args, flags] {
    const std::vector<std::string> overrides = flags->apply(args->overrides);
    RunConfig cfg = load_run_config(args->config, overrides);
    cfg.model.check_trainable();
    if (args->dry_run) {
      const nlohmann::json all = cfg.to_json();
      fmt::print("{}\n", (args->all ? all : changed_from(all, RunConfig().to_json())).dump(2));
      print_memory_table(cfg, args->np);
      return 0;
    }
    if (!args->init_from.empty()) {
      adopt_architecture(cfg.model, model_config_of(args->init_from), args->init_from);
      cfg.validate();
    }
    const std::unique_ptr<CollectiveWatchdog> watchdog = watch_collectives(cfg.dist);
    Trainer trainer(cfg, args->resume);
    if (!args->init_from.empty()) trainer.init_weights_from(args->init_from);
    // One process alone: its threads each on a core of their own (core/threads.h). A distributed
    // run's processes keep theirs unpinned: their communication threads would inherit one core.
    if (trainer.world_size() == 1) pin_threads();
    TrainResult r = trainer.run();
    if (r.exit_code != 0) return r.exit_code;
    if (trainer.rank() != 0) return 0;  // one summary for the whole run
    fmt::print(
        "steps {} | final train loss {:.4f} | validation loss {:.4f} {} | {:.0f} tokens/s | "
        "{:.1f} s\n",
        r.steps_done, r.final_loss, r.val_loss, kLmLossUnit, r.tokens_per_s, r.seconds);
    if (r.peak_rss >= 0)
      fmt::print("memory per rank: peak resident {:.1f} MiB (the largest rank's VmHWM), estimated "
                 "{:.1f} MiB\n",
                 r.peak_rss / kMiB, trainer.memory_estimate().total() / kMiB);
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
      ->check(integer_in(1));
  return [args] {
    init_threads();
    LoadedModel m = load_model(args->checkpoint);
    std::filesystem::path dir = args->data.empty() ? m.config.data.dir : args->data;
    const Tokenizer data_tok = data_tokenizer(dir);
    MOETRAIN_CHECK(data_tok.fingerprint() == m.tokenizer.fingerprint(),
                   "eval: {} was prepared with the tokenizer {}, the checkpoint {} was trained with "
                   "{}: prepare the data with the checkpoint's (`moetrain prepare --tokenizer {}`)",
                   (dir / "meta.json").string(), data_tok.fingerprint(), args->checkpoint,
                   m.tokenizer.fingerprint(), m.tokenizer.is_bytes() ? "byte" : args->checkpoint);
    TokenShard val(dir / "val.bin");
    MOETRAIN_CHECK(val.vocab() <= m.config.model.vocab_size,
                   "eval: {} has vocabulary {}, larger than the model's ({})", val.path().string(),
                   val.vocab(), m.config.model.vocab_size);
    int64_t batches = args->batches > 0 ? args->batches : m.config.train.eval_batches;
    double loss = evaluate(*m.model, m.params.data(), val, m.config.train.batch_size,
                           m.config.train.seq_len, batches);
    fmt::print("step {} | validation loss {:.4f} {} over {} batches of {}x{}\n", m.step, loss,
               kLmLossUnit, batches, m.config.train.batch_size, m.config.train.seq_len);
    return 0;
  };
}

}  // namespace moetrain::app
