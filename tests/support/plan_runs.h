// What the planner's binary-level tests share: the files of configs/plan and the JSON document
// of a `moetrain plan --json` run's output (the config's notes on stderr come before it, an
// error after it).
#pragma once
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "ft/ft_support.h"

namespace moetrain::testing {

inline std::string plan_file(const std::string& name) {
  return std::string(MOETRAIN_SOURCE_DIR) + "/configs/plan/" + name;
}

// The document alone: an error printed after it (a layout that does not fit) is not part of it.
inline nlohmann::json json_of(const ProcessResult& r) {
  const std::string out = r.output();
  const std::size_t start = out.rfind('{', 0) == 0 ? 0 : out.find("\n{") + 1;
  std::istringstream in(out.substr(start));
  nlohmann::json j;
  in >> j;
  return j;
}

}  // namespace moetrain::testing
