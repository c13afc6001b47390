// `prepare`: turn a corpus (data/corpus.h: text files, directories, JSONL, gzip or zstd) into
// token shards DIR/train.bin, DIR/val.bin and the manifest DIR/meta.json (docs/data.md).
//
// Each document is encoded by the tokenizer (bytes by default, or a SentencePiece model, copied
// to DIR/tokenizer.model) and followed by the tokenizer's end-of-document token. The documents are
// read as a stream and encoded in parallel a batch at a time; their tokens go to a temporary file
// in DIR, so a corpus larger than memory prepares in memory of the order of a batch.
//
// Split: the token stream is cut into chunks of `split_chunk_tokens` tokens and chunk i goes to
// val when floor((i+1)·f) > floor(i·f), f = val_fraction. That spreads val evenly over the whole
// corpus (one chunk in every 1/f) instead of taking the tail of the last file, keeps val pieces
// contiguous text, gives floor(chunks·f) val chunks, and always puts chunk 0 in train.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "data/corpus.h"
#include "data/tokenizer.h"

namespace moetrain {

struct PrepareOptions {
  std::vector<std::filesystem::path> inputs;  // files or directories
  std::filesystem::path out_dir;
  double val_fraction = 0.05;  // in [0, 1)
  Tokenizer tokenizer;         // bytes by default
  std::string jsonl_field = "text";
  BadLines bad_lines = BadLines::Refuse;
  bool progress = false;        // a progress bar on stderr
  std::size_t batch_bytes = std::size_t{8} << 20;  // text encoded in parallel at a time
};

struct PrepareReport {
  std::vector<CorpusSource> sources;  // in order
  std::vector<CorpusSkipped> skipped;
  uint64_t bytes_taken = 0;  // text of the documents read (decompressed)
  uint64_t bytes_skipped = 0;
  uint64_t documents = 0;
  uint64_t bad_lines = 0;
  uint64_t chunk_tokens = 0;
  uint64_t train_tokens = 0;
  uint64_t val_tokens = 0;
};

// Chunk size for a stream of `total` tokens: about 16 val chunks for small corpora, at most 8192.
uint64_t split_chunk_tokens(uint64_t total, double val_fraction);
bool is_val_chunk(uint64_t chunk, double val_fraction);

// Throws Error for a missing input, an empty corpus, a bad JSONL line (BadLines::Refuse), a val
// fraction outside [0, 1) or an output directory that cannot be created or written. Nothing in
// DIR is replaced until every document has been read.
PrepareReport prepare_corpus(const PrepareOptions& options);

}  // namespace moetrain
