// "Did you mean ...?": the known word nearest to a mistyped one, by edit distance.
#pragma once
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain {

// Levenshtein distance (insertions, deletions, substitutions; each costs 1); a transposition of
// two neighbours counts 1 as well ("n_exeprts").
std::size_t edit_distance(std::string_view a, std::string_view b);

// The candidate nearest to `word`, when it is near enough to be what was meant: at most a third
// of the word's length away (at least 1, at most 3 edits). Ties go to the first candidate.
std::optional<std::string> nearest(std::string_view word,
                                   const std::vector<std::string>& candidates);

}  // namespace moetrain
