// Test support: a small token corpus (train.bin, val.bin) in `dir`, from real English text of the
// fortunes package when present, else a fixed text; at most `max_bytes` bytes, a tenth for val.
// And synthetic tokens whose values name their positions.
#pragma once
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <cstdint>
#include <string>
#include <vector>

#include "data/shard.h"
#include "data/tokenizer.h"

namespace moetrain::testing {

inline void write_corpus(const std::filesystem::path& dir, std::size_t max_bytes) {
  std::string text;
  std::ifstream in("/usr/share/games/fortunes/fortunes", std::ios::binary);
  if (in) text.assign(std::istreambuf_iterator<char>(in), {});
  if (text.size() < 20000) {
    text.clear();
    for (int i = 0; i < 800; ++i)
      text += "The quick brown fox jumps over the lazy dog " + std::to_string(i) + ".\n";
  }
  text.resize(std::min(text.size(), max_bytes));
  auto tokens = byte_encode(text);
  std::size_t val = tokens.size() / 10;
  std::filesystem::create_directories(dir);
  write_token_shard(dir / "train.bin", tokens.data(), tokens.size() - val, kByteVocab);
  write_token_shard(dir / "val.bin", tokens.data() + tokens.size() - val, val, kByteVocab);
}

// Tokens whose token i is a scrambled function of i (< 256), so a window's content names its start.
inline std::vector<uint16_t> scrambled_tokens(uint64_t n) {
  std::vector<uint16_t> t(n);
  for (uint64_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>((i * 2654435761u) >> 7 & 0xFF);
  return t;
}

}  // namespace moetrain::testing
