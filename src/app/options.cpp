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
    // The values object outlives cmd's parse: main keeps the subcommand's Run, which holds it.
    std::string* given = &values->given_[i];
    auto as_text = [given](const auto& v) { *given = fmt::format("{}", v); };
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
            f.name, [given, value = f.value] { *given = value; }, f.help);
        break;
    }
    if (f.check) opt->check(*f.check);
  }
  return values;
}

}  // namespace moetrain::app
