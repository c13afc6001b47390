// Byte-level tokenizer: the vocabulary is the 256 byte values and a token is its byte. Nothing to
// train or ship, any input is representable, and decoding is exact.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain {

constexpr uint32_t kByteVocab = 256;

std::vector<uint16_t> byte_encode(std::string_view text);
// out: (text.size())
void byte_encode(std::string_view text, uint16_t* out);
// Throws Error naming the position and value of a token outside [0, 256).
std::string byte_decode(std::span<const uint16_t> tokens);
std::string byte_decode(std::span<const int32_t> tokens);

}  // namespace moetrain
