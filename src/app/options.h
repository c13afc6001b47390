// Command-line options that stand for configuration keys: each one, when given, adds a
// `--set`-style override (key=value), so the configuration loader checks it like any other key
// and names the key in its errors. One table per subcommand, one place that turns it into CLI11
// options and the options given into overrides.
#pragma once
#include <CLI/CLI.hpp>

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace moetrain::app {

struct ConfigFlag {
  enum class Kind { Int, Number, Text, Switch };
  const char* name;  // "--ep"
  Kind kind;
  const char* key;  // "dist.ep"
  const char* help;
  // Switch: the value a given switch sets ("true", "false"). Other kinds: the value given.
  const char* value = nullptr;
  // Another override the option implies when given, set before its own ("dist.hierarchical=true").
  const char* implies = nullptr;
  std::optional<CLI::Validator> check = {};
};

// The values given on one command line, in the table's order.
class ConfigFlagValues {
 public:
  // The overrides of the options given, appended to `overrides` (which they take precedence
  // over), in the table's order.
  std::vector<std::string> apply(std::vector<std::string> overrides) const;

 private:
  friend std::shared_ptr<ConfigFlagValues> add_config_flags(CLI::App*, std::span<const ConfigFlag>);
  std::vector<ConfigFlag> flags_;
  std::vector<std::string> given_;  // (flags_): the value, empty when not given
};

// Adds the table's options to cmd in its order; the values land in the returned object once cmd
// has parsed.
std::shared_ptr<ConfigFlagValues> add_config_flags(CLI::App* cmd,
                                                   std::span<const ConfigFlag> flags);

// The overrides of the table's options given on `cmd`, parsed but not run (`moetrain launch`
// checks the train command it will start), appended to `overrides` as ConfigFlagValues::apply
// does.
std::vector<std::string> given_config_flags(const CLI::App& cmd, std::span<const ConfigFlag> flags,
                                            std::vector<std::string> overrides);

// --mpi-arg, repeatable: words passed to mpirun as they are, for the commands that run it
// (launch, plan --calibrate): --mpi-arg=--allow-run-as-root, --mpi-arg=--oversubscribe.
CLI::Option* add_mpi_arg_option(CLI::App* cmd, std::vector<std::string>& into);

}  // namespace moetrain::app
