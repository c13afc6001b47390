// `moetrain tokenizer train`: a SentencePiece tokenizer learnt from a corpus (data/corpus.h), in
// the form Llama and Mixtral ship: identity normalisation (text kept as it is), whitespace kept,
// digits split, byte fallback (any byte sequence encodes, none becomes <unk>), and the special
// pieces <unk> = 0, <s> = 1, </s> = 2.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

#include "data/corpus.h"
#include "data/tokenizer.h"

namespace moetrain {

struct TokenizerTrainOptions {
  CorpusOptions corpus;
  std::filesystem::path out_dir;  // receives tokenizer.model and the Hugging Face files
  int64_t vocab_size = 8000;
  std::string model_type = "bpe";  // bpe | unigram
  // Sentences (lines) sampled for training; SentencePiece's own limit on what it holds in memory.
  int64_t max_sentences = 2'000'000;
  uint64_t seed = 1;
};

// Trains, writes OUT/tokenizer.model, OUT/tokenizer_config.json and OUT/special_tokens_map.json,
// and returns the tokenizer. Throws Error naming the value for a vocabulary size outside
// [kMinTrainedVocab, 2^31 - 1] or one the corpus cannot fill, an unknown model type, or an empty
// corpus.
constexpr int64_t kMinTrainedVocab = 260;  // 256 byte pieces + the 3 special ones + 1
Tokenizer train_tokenizer(const TokenizerTrainOptions& options);

}  // namespace moetrain
