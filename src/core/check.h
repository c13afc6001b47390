// Errors: MOETRAIN_CHECK(cond, "format {}", values...) throws moetrain::Error carrying file:line.
// `main` is the only catch site. Hot loops never check; layers check at entry.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace moetrain {

class Error : public std::runtime_error {
 public:
  Error(const char* file, int line, const std::string& message)
      : std::runtime_error(message), file_(file), line_(line) {}
  const char* file() const { return file_; }
  int line() const { return line_; }
  // "src/x.cpp:12": where the error was raised, for the debug log (a user's message is what())
  std::string location() const;
  // "message (at src/x.cpp:12)"
  std::string describe() const;

 private:
  const char* file_;
  int line_;
};

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, const std::string& message);
}  // namespace detail

}  // namespace moetrain

#define MOETRAIN_CHECK(cond, ...)                                                      \
  do {                                                                                 \
    if (!(cond)) [[unlikely]] {                                                        \
      ::moetrain::detail::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__)); \
    }                                                                                  \
  } while (0)

#define MOETRAIN_FAIL(...) \
  ::moetrain::detail::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__))
