// `prepare`: turn text files into byte-token shards DIR/train.bin, DIR/val.bin and DIR/meta.json.
//
// Inputs are files or directories (every regular file inside, recursively, sorted by path). Inside
// directories, symlinks and `*.dat` files are skipped (the Debian fortunes package ships binary
// `.dat` indexes and `.u8` symlinks next to its text). Tokens are bytes, so a text in any encoding
// (UTF-8, Latin-1, ...) is taken as it is; a file with a NUL byte is skipped as binary (compressed,
// an image), as are empty files. The texts are concatenated with '\n' between files.
//
// Split: the stream is cut into chunks of `split_chunk_bytes` bytes and chunk i goes to val when
// floor((i+1)·f) > floor(i·f), f = val_fraction. That spreads val evenly over the whole corpus (one
// chunk in every 1/f) instead of taking the tail of the last file, keeps val pieces contiguous
// text, gives floor(chunks·f) val chunks, and always puts chunk 0 in train.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moetrain {

struct PrepareOptions {
  std::vector<std::filesystem::path> inputs;  // files or directories
  std::filesystem::path out_dir;
  double val_fraction = 0.05;  // in [0, 1)
};

struct PrepareSource {
  std::string path;
  uint64_t bytes = 0;
};

struct PrepareSkipped {
  std::string path;
  std::string reason;
  uint64_t bytes = 0;
};

struct PrepareReport {
  std::vector<PrepareSource> sources;  // in concatenation order
  std::vector<PrepareSkipped> skipped;
  uint64_t bytes_taken = 0;  // sum of source sizes (separators not counted)
  uint64_t bytes_skipped = 0;
  uint64_t chunk_bytes = 0;
  uint64_t train_tokens = 0;
  uint64_t val_tokens = 0;
};

// Chunk size for a corpus of `total` bytes: about 16 val chunks for small corpora, at most 8 KiB.
uint64_t split_chunk_bytes(uint64_t total, double val_fraction);
bool is_val_chunk(uint64_t chunk, double val_fraction);

// Throws Error for a missing input, an empty corpus, a val fraction outside [0, 1) or an output
// directory that cannot be created or written.
PrepareReport prepare_text_corpus(const PrepareOptions& options);

}  // namespace moetrain
