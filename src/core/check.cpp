#include "core/check.h"

#include <cstring>

namespace moetrain {

std::string Error::describe() const {
  // Show the path from src/ on: the build machine's prefix says nothing to a user.
  const char* shown = file_;
  if (const char* p = std::strstr(file_, "src/")) shown = p;
  return fmt::format("{} (at {}:{})", what(), shown, line_);
}

namespace detail {
void throw_error(const char* file, int line, const std::string& message) {
  throw Error(file, line, message);
}
}  // namespace detail

}  // namespace moetrain
