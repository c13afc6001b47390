// `moetrain report RUN_DIR [--out FILE]`: the run's HTML report (io/report.h).
#include <fmt/format.h>

#include <memory>

#include "app/commands.h"
#include "io/report.h"

namespace moetrain::app {

Run add_report_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "report",
      "Write a self-contained HTML report of a run: curves, expert load, config, checkpoints");
  struct Args {
    std::string run_dir, out;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("run_dir", args->run_dir, "Run directory (train.run_dir)")->required();
  cmd->add_option("--out", args->out, "HTML file to write (default RUN_DIR/report.html)");
  return [args] {
    const auto path = write_report(args->run_dir, args->out);
    fmt::print("{}\n", path.string());
    return 0;
  };
}

}  // namespace moetrain::app
