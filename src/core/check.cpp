#include "core/check.h"

#include <cstring>

namespace moetrain {

std::string Error::location() const {
  // The path from src/ on: the build machine's prefix says nothing.
  const char* shown = file_;
  if (const char* p = std::strstr(file_, "src/")) shown = p;
  return fmt::format("{}:{}", shown, line_);
}

std::string Error::describe() const {
  return fmt::format("{} (at {})", what(), location());
}

namespace detail {
void throw_error(const char* file, int line, const std::string& message) {
  throw Error(file, line, message);
}
}  // namespace detail

}  // namespace moetrain
