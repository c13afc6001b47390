// Whole numbers and lists from command-line text: one rule for every flag that takes them.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain {

// The whole number that is all of `text` (decimal digits, an optional leading '-'), if it fits
// in int64; nullopt for anything else ("", "3x", "1.5", " 2", overflow).
std::optional<int64_t> parse_whole(std::string_view text);

// The items of `text` separated by commas, and by whitespace too when `spaces`. A trailing
// separator ends the list. With `spaces` empty items are dropped; without, "2,,4" keeps its empty
// middle item for the caller to refuse.
std::vector<std::string> split_list(std::string_view text, bool spaces = false);

}  // namespace moetrain
