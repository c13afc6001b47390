#include "data/tokenizer.h"

#include <type_traits>

#include "core/check.h"

namespace moetrain {

void byte_encode(std::string_view text, uint16_t* out) {
  for (std::size_t i = 0; i < text.size(); ++i) out[i] = static_cast<uint8_t>(text[i]);
}

std::vector<uint16_t> byte_encode(std::string_view text) {
  std::vector<uint16_t> out(text.size());
  byte_encode(text, out.data());
  return out;
}

namespace {
template <typename T>
std::string decode(std::span<const T> tokens) {
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    bool in_vocab;
    if constexpr (std::is_signed_v<T>) {
      in_vocab = tokens[i] >= 0 && static_cast<uint32_t>(tokens[i]) < kByteVocab;
    } else {
      in_vocab = static_cast<uint32_t>(tokens[i]) < kByteVocab;
    }
    MOETRAIN_CHECK(in_vocab,
                   "byte_decode: token {} at position {} is outside the byte vocabulary [0, {})",
                   tokens[i], i, kByteVocab);
  }
  std::string out(tokens.size(), '\0');
  for (std::size_t i = 0; i < tokens.size(); ++i)
    out[i] = static_cast<char>(static_cast<uint8_t>(tokens[i]));
  return out;
}
}  // namespace

std::string byte_decode(std::span<const uint16_t> tokens) {
  return decode(tokens);
}
std::string byte_decode(std::span<const int32_t> tokens) {
  return decode(tokens);
}

}  // namespace moetrain
