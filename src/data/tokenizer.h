// Tokenizers: text <-> token ids. Two kinds, one interface:
//   byte           the vocabulary is the 256 byte values and a token is its byte. Nothing to train
//                  or ship, any input is representable, decoding is exact. The default.
//   sentencepiece  a SentencePiece model (`tokenizer.model`, the format Mixtral and Llama ship):
//                  trained by `moetrain tokenizer train` or taken from a Hugging Face directory.
//
// A document ends with the tokenizer's end-of-document token: `</s>` for SentencePiece, '\n' for
// bytes (which have no special tokens). Encoding adds no begin-of-sequence token, as the Hugging
// Face files written beside a checkpoint say (add_bos_token = false), so moetrain and
// transformers give the same ids for the same text.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain {

constexpr uint32_t kByteVocab = 256;
// The file a SentencePiece tokenizer is kept in: in a data directory, beside a checkpoint's
// weights, in a Hugging Face model directory.
constexpr const char* kTokenizerFile = "tokenizer.model";

std::vector<uint16_t> byte_encode(std::string_view text);
// out: (text.size())
void byte_encode(std::string_view text, uint16_t* out);
// Throws Error naming the position and value of a token outside [0, 256).
std::string byte_decode(std::span<const uint16_t> tokens);
std::string byte_decode(std::span<const int32_t> tokens);

class Tokenizer {
 public:
  // The byte tokenizer.
  Tokenizer();
  // A SentencePiece model's bytes (a tokenizer.model's contents); `source` names it in errors.
  static Tokenizer sentencepiece(std::string model_bytes, const std::string& source);
  // DIR/tokenizer.model when there is one, else the byte tokenizer. Throws naming the file if it
  // exists but is not a SentencePiece model. DIR/tokenizer_config.json's add_bos_token, where
  // there is one, says whether a prompt starts with <s> (a Mixtral directory's does).
  static Tokenizer from_dir(const std::filesystem::path& dir);

  bool is_bytes() const { return impl_ == nullptr; }
  // "byte" or "sentencepiece".
  std::string kind() const;
  int64_t vocab_size() const;
  // The token that ends a document ('\n' for bytes).
  int32_t eod_id() const;
  // "byte", or "sentencepiece:" and the CRC-32C of the model's bytes: equal fingerprints encode
  // every text to the same ids. Recorded with shards and checkpoints, compared before training.
  const std::string& fingerprint() const;
  // The SentencePiece model's bytes; empty for bytes.
  const std::string& model_bytes() const;

  std::vector<int32_t> encode(std::string_view text) const;
  // A prompt to continue: encode(), after <s> where the directory's tokenizer_config.json asks
  // for it (as transformers' tokenizer of that directory encodes it).
  std::vector<int32_t> encode_prompt(std::string_view text) const;
  // Appends text's tokens to out.
  void encode_into(std::string_view text, std::vector<int32_t>& out) const;
  // Throws Error naming the position and value of a token outside the vocabulary.
  std::string decode(std::span<const int32_t> ids) const;

  // The files that make DIR load in Hugging Face transformers (AutoTokenizer, pipeline):
  // tokenizer.model, tokenizer_config.json, special_tokens_map.json, as name -> bytes. Empty for
  // bytes (transformers has no tokenizer with these ids). max_length: the model's context.
  std::vector<std::pair<std::string, std::string>> hf_files(int64_t max_length) const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
  std::string fingerprint_ = "byte";
  bool add_bos_ = false;
};

// The vocabulary size of the tokenizer data_dir was prepared with (its meta.json), or 256 (bytes)
// where there is no meta.json. Throws naming the file if it cannot be read.
int64_t data_vocab_size(const std::filesystem::path& data_dir);

// --tokenizer: "byte", a tokenizer.model file, or a directory holding one (what `moetrain tokenizer
// train` wrote, a Hugging Face model directory, a checkpoint). Throws naming the path otherwise.
Tokenizer load_tokenizer(const std::string& spec);

// The tokenizer a data directory was prepared with (DIR/meta.json names it; its model is
// DIR/tokenizer.model). A directory without meta.json is taken as bytes.
Tokenizer data_tokenizer(const std::filesystem::path& data_dir);

}  // namespace moetrain
