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
    // Not given, the key keeps what the config file (else the built-in default) says.
    const std::string help = f.kind == ConfigFlag::Kind::Switch
                                 ? fmt::format("{} [sets {}={}]", f.help, f.key, f.value)
                                 : fmt::format("{} [default: the config's {}]", f.help, f.key);
    switch (f.kind) {
      case ConfigFlag::Kind::Int:
        opt = cmd->add_option_function<int64_t>(f.name, as_text, help);
        break;
      case ConfigFlag::Kind::Number:
        opt = cmd->add_option_function<double>(f.name, as_text, help);
        break;
      case ConfigFlag::Kind::Text:
        opt = cmd->add_option_function<std::string>(f.name, as_text, help);
        break;
      case ConfigFlag::Kind::Switch:
        opt = cmd->add_flag_callback(
            f.name, [values, i, value = f.value] { values->given_[i] = value; }, help);
        break;
    }
    if (f.check) opt->check(*f.check);
  }
  return values;
}

std::vector<std::string> given_config_flags(const CLI::App& cmd, std::span<const ConfigFlag> flags,
                                            std::vector<std::string> overrides) {
  for (const ConfigFlag& f : flags) {
    const CLI::Option* opt = cmd.get_option_no_throw(f.name);
    if (opt == nullptr || opt->count() == 0) continue;
    if (f.implies) overrides.emplace_back(f.implies);
    overrides.push_back(fmt::format(
        "{}={}", f.key,
        f.kind == ConfigFlag::Kind::Switch ? std::string(f.value) : opt->as<std::string>()));
  }
  return overrides;
}

CLI::Option* add_mpi_arg_option(CLI::App* cmd, std::vector<std::string>& into) {
  // `=` keeps CLI11 from reading a word that starts with dashes as an option of ours.
  return cmd->add_option("--mpi-arg", into,
                         "An argument for mpirun, repeatable, written with '=': "
                         "--mpi-arg=--allow-run-as-root");
}

}  // namespace moetrain::app
