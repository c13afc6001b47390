// Each subcommand lives in its own file and registers itself on the CLI here; main() runs
// whichever was chosen. A command returns the process exit code.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>

namespace moetrain::app {

using Run = std::function<int()>;

Run add_version_command(CLI::App& app);
Run add_prepare_command(CLI::App& app);
Run add_tokenizer_command(CLI::App& app);
Run add_train_command(CLI::App& app);
Run add_eval_command(CLI::App& app);
Run add_sample_command(CLI::App& app);
Run add_forward_command(CLI::App& app);
Run add_classify_command(CLI::App& app);
Run add_launch_command(CLI::App& app);
Run add_report_command(CLI::App& app);
Run add_plan_command(CLI::App& app);
Run add_config_command(CLI::App& app);
#ifdef MOETRAIN_WITH_ZMQ
Run add_ps_command(CLI::App& app);
#endif

}  // namespace moetrain::app
