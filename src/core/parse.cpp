#include "core/parse.h"

#include <charconv>

namespace moetrain {

std::optional<int64_t> parse_whole(std::string_view text) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  if (text.empty() || text.front() == '+') return std::nullopt;
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc{} || ptr != end) return std::nullopt;
  return v;
}

std::vector<std::string> split_list(std::string_view text, bool spaces) {
  std::vector<std::string> out;
  auto is_sep = [spaces](char c) {
    return c == ',' || (spaces && (c == ' ' || c == '\t' || c == '\n'));
  };
  std::string item;
  for (char c : text) {
    if (is_sep(c)) {
      if (!spaces || !item.empty()) out.push_back(item);
      item.clear();
    } else {
      item += c;
    }
  }
  if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace moetrain
