#include "app/checks.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <string>
#include <system_error>

namespace moetrain::app {

namespace {

// The value without one leading '+', which from_chars does not take.
std::string_view digits(const std::string& s) {
  std::string_view v = s;
  if (!v.empty() && v.front() == '+') v.remove_prefix(1);
  return v;
}

template <typename T>
std::string parse_integer(const std::string& s, T& out) {
  const std::string_view v = digits(s);
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec == std::errc::result_out_of_range)
    return fmt::format("{} is out of range: must be <= {}", s, std::numeric_limits<T>::max());
  if (ec != std::errc() || end != v.data() + v.size() || v.empty())
    return fmt::format("{} is not {}", s,
                       std::is_signed_v<T> ? "an integer" : "a non-negative integer");
  return {};
}

}  // namespace

CLI::Validator number_at_least(double lo) {
  return CLI::Validator(
      [lo](std::string& s) -> std::string {
        const std::string_view v = digits(s);
        double x = 0;
        const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
        if ((ec != std::errc() && ec != std::errc::result_out_of_range) ||
            end != v.data() + v.size() || v.empty())
          return fmt::format("{} is not a number", s);
        if (ec == std::errc::result_out_of_range || !std::isfinite(x))
          return fmt::format("{} is not a finite number", s);
        if (x < lo) return fmt::format("{} must be >= {}", s, lo);
        return {};
      },
      fmt::format("NUMBER >= {}", lo));
}

CLI::Validator integer_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        int64_t x = 0;
        if (std::string err = parse_integer(s, x); !err.empty()) return err;
        if (x < lo) return fmt::format("{} must be >= {}", s, lo);
        if (x > hi) return fmt::format("{} must be <= {}", s, hi);
        return {};
      },
      hi == std::numeric_limits<int64_t>::max() ? fmt::format("INT >= {}", lo)
                                                : fmt::format("INT in [{}, {}]", lo, hi));
}

CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        uint64_t x = 0;
        return parse_integer(s, x);
      },
      "UINT");
}

}  // namespace moetrain::app
