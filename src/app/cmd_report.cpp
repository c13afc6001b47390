// `moetrain report RUN_DIR [--out FILE]`: the run's HTML report (io/report.h).
// `moetrain report --ablation DIR [--warmup N]`: the ablation table of scripts/ablation.sh's
// runs (io/ablation_table.h) as DIR/table.md, DIR/table.json and DIR/ablation.svg.
#include <fmt/format.h>

#include <memory>

#include "app/commands.h"
#include "io/ablation_table.h"
#include "io/report.h"
#include "train/classifier_config.h"
#include "train/run_config.h"

namespace moetrain::app {

// The defaults the report's config table compares with: the one schema's, of each kind of run.
SettingDefaults setting_defaults() {
  return {RunConfig{}.to_json(), ClassifierRunConfig{}.to_json()};
}

Run add_report_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "report",
      "Write a self-contained HTML report of a run: curves, expert load, config, checkpoints");
  struct Args {
    std::string run_dir, out;
    bool ablation = false;
    int64_t warmup = 2;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("run_dir", args->run_dir,
                  "Run directory (train.run_dir); with --ablation, the ablation output folder")
      ->required();
  cmd->add_option("--out", args->out, "HTML file to write (default RUN_DIR/report.html)");
  cmd->add_flag("--ablation", args->ablation,
                "RUN_DIR holds scripts/ablation.sh's runs (runs/ROW/RUN): write its table "
                "(table.md, table.json, ablation.svg) there instead of a run report");
  cmd->add_option("--warmup", args->warmup,
                  "With --ablation: steps at the start of each run left out of the timings")
      ->check(CLI::NonNegativeNumber);
  return [args] {
    const auto path = args->ablation ? write_ablation(args->run_dir, args->warmup)
                                     : write_report(args->run_dir, setting_defaults(), args->out);
    fmt::print("{}\n", path.string());
    return 0;
  };
}

}  // namespace moetrain::app
