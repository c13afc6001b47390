// `moetrain classify`: trains the MoE classifier on Fashion-MNIST.
#include <fmt/format.h>

#include <memory>

#include "app/commands.h"
#include "app/dist_options.h"
#include "core/threads.h"
#include "train/classifier_config.h"
#include "train/classifier_trainer.h"

namespace moetrain::app {

Run add_classify_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "classify", "Train the MoE image classifier (Fashion-MNIST) from a TOML config");
  struct Args {
    std::string config;
    std::vector<std::string> overrides;
    bool resume = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("-c,--config", args->config, "TOML config file (e.g. configs/fashion_mnist.toml)")
      ->required();
  cmd->add_option("--set", args->overrides,
                  "Override a config key: --set train.steps=500 (repeatable)");
  cmd->add_flag("--resume", args->resume,
                "Continue from the run directory's latest complete checkpoint");
  static const std::vector<ConfigFlag> config_flags = [] {
    std::vector<ConfigFlag> f = run_config_flags();
    const std::vector<ConfigFlag>& dist = dist_config_flags();
    f.insert(f.end(), dist.begin(), dist.end());
    return f;
  }();
  auto flags = add_config_flags(cmd, config_flags);
  return [args, flags] {
    const std::vector<std::string> overrides = flags->apply(args->overrides);
    ClassifierRunConfig cfg = load_classifier_config(args->config, overrides);
    const std::unique_ptr<CollectiveWatchdog> watchdog = watch_collectives(cfg.dist);
    ClassifierTrainer trainer(cfg, {}, args->resume);
    if (trainer.world_size() == 1) pin_threads();  // as train
    ClassifierTrainResult r = trainer.run();
    if (r.exit_code != 0) return r.exit_code;
    if (trainer.rank() != 0) return 0;  // one summary for the whole run
    fmt::print(
        "steps {} | final train loss {:.4f} | test accuracy {:.2f}% | test loss {:.4f} | {:.0f} "
        "images/s | "
        "{:.1f} s\n",
        r.steps_done, r.final_loss, 100 * r.test_accuracy, r.test_loss, r.images_per_s, r.seconds);
    fmt::print("checkpoint: {}\n", r.last_checkpoint.string());
    return 0;
  };
}

}  // namespace moetrain::app
