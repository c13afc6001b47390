#include "app/options.h"

#include <fmt/format.h>

#include <cstdint>

namespace moetrain::app {

std::vector<std::string> ConfigFlagValues::apply(std::vector<std::string> overrides) const {
  for (std::size_t i = 0; i < flags_.size(); ++i) {
    if (given_[i].empty()) continue;
    if (flags_[i].implies) overrides.emplace_back(flags_[i].implies);
    overrides.push_back(fmt::format("{}={}", flags_[i].key, given_[i]));
  }
  return overrides;
}

std::shared_ptr<ConfigFlagValues> add_config_flags(CLI::App* cmd,
                                                   std::span<const ConfigFlag> flags) {
  auto values = std::make_shared<ConfigFlagValues>();
  values->flags_.assign(flags.begin(), flags.end());
  values->given_.assign(flags.size(), std::string());
  for (std::size_t i = 0; i < flags.size(); ++i) {
    const ConfigFlag& f = flags[i];
    // The callbacks share ownership of the values: a command line may be parsed after the
    // caller dropped its handle (`moetrain launch` checks the train command it will run).
    auto as_text = [values, i](const auto& v) { values->given_[i] = fmt::format("{}", v); };
    CLI::Option* opt = nullptr;
    switch (f.kind) {
      case ConfigFlag::Kind::Int:
        opt = cmd->add_option_function<int64_t>(f.name, as_text, f.help);
        break;
      case ConfigFlag::Kind::Number:
        opt = cmd->add_option_function<double>(f.name, as_text, f.help);
        break;
      case ConfigFlag::Kind::Text:
        opt = cmd->add_option_function<std::string>(f.name, as_text, f.help);
        break;
      case ConfigFlag::Kind::Switch:
        opt = cmd->add_flag_callback(
            f.name, [values, i, value = f.value] { values->given_[i] = value; }, f.help);
        break;
    }
    if (f.check) opt->check(*f.check);
  }
  return values;
}

CLI::Option* add_mpi_arg_option(CLI::App* cmd, std::vector<std::string>& into) {
  // `=` keeps CLI11 from reading a word that starts with dashes as an option of ours.
  return cmd->add_option("--mpi-arg", into,
                         "An argument for mpirun, repeatable, written with '=': "
                         "--mpi-arg=--allow-run-as-root");
}

}  // namespace moetrain::app
