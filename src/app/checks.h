// Range checks for command-line values. CLI11's own (NonNegativeNumber, PositiveNumber) let nan
// and inf through, leave integers past the type's range to wrap (--seed -1 became 2^64 - 1), and
// name the type's limits in their messages (a 309-digit DBL_MAX); these refuse all three and say
// the rule: "--temperature: nan is not a finite number", "--batches: 0 must be >= 1".
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <limits>

namespace moetrain::app {

// A finite real number >= lo.
CLI::Validator number_at_least(double lo);
// A decimal integer in [lo, hi].
CLI::Validator integer_in(int64_t lo, int64_t hi = std::numeric_limits<int64_t>::max());
// A decimal integer in [0, 2^64 - 1] (seeds).
CLI::Validator unsigned_integer();

}  // namespace moetrain::app
