// Test support: expect a moetrain::Error whose message names every given piece; the message of
// what a call throws.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/check.h"

namespace moetrain::testing {

inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no moetrain::Error thrown; expected one mentioning '"
                  << (needles.empty() ? "" : needles[0]) << "'";
  } catch (const moetrain::Error& e) {
    const std::string msg = e.what();
    for (const auto& s : needles)
      EXPECT_NE(msg.find(s), std::string::npos) << "'" << s << "' not in: " << msg;
  }
}

// The message of the moetrain::Error fn throws, or "" when it throws none.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const moetrain::Error& e) {
    return e.what();
  }
  return "";
}

// One needle. (A const char* rather than a string: a braced pair of literals must not be taken
// for a string's iterator range.)
inline void expect_error(const std::function<void()>& fn, const char* needle) {
  expect_error(fn, std::vector<std::string>{needle});
}

}  // namespace moetrain::testing
