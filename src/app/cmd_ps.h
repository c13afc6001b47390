// What `ps scheduler` (cmd_ps.cpp) and `ps launch` (cmd_ps_launch.cpp) share: the job options, as
// flags and as the arguments launch hands on to the schedulers it starts.
#pragma once
#ifdef MOETRAIN_WITH_ZMQ
#include <string>
#include <vector>

#include "app/commands.h"
#include "ps/options.h"

namespace moetrain::app {

void add_job_options(CLI::App* cmd, ps::PsOptions& o);
std::vector<std::string> job_option_args(const ps::PsOptions& o);

// Registers `ps launch` on the `ps` command; the Run starts the job when launch was chosen.
Run add_ps_launch_command(CLI::App* ps_cmd);

}  // namespace moetrain::app

#endif  // MOETRAIN_WITH_ZMQ
