// `moetrain config list [SECTION]`: the keys a config file and --set take, from the schema the
// loader validates with.
#include <fmt/format.h>

#include <memory>
#include <string>

#include "app/commands.h"
#include "train/classifier_config.h"
#include "train/run_config.h"

namespace moetrain::app {

Run add_config_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("config", "What a config file and --set take: config list");
  cmd->require_subcommand(1);
  auto* list = cmd->add_subcommand(
      "list",
      "Every config key (of SECTION only, when given) with its type, default, allowed values "
      "and what it does");
  struct Args {
    std::string section;
    bool classify = false;
  };
  auto args = std::make_shared<Args>();
  list->add_option("section", args->section, "A section: model, optim, train, dist, ...");
  list->add_flag("--classify", args->classify,
                 "The keys of `moetrain classify` (default: those of train)");
  return [args] {
    fmt::print("{}", args->classify ? classifier_config_help(args->section)
                                    : run_config_help(args->section));
    return 0;
  };
}

}  // namespace moetrain::app
