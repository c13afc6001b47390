// Corpora: the documents of text files, directories of them and JSONL files, plain or compressed,
// read as a stream (a corpus larger than memory passes through a block at a time).
//
// Inputs are files or directories (every regular file inside, recursively, sorted by path). Inside
// directories, symlinks and `*.dat` files are skipped (the Debian fortunes package ships binary
// `.dat` indexes and `.u8` symlinks next to its text). A file compressed with gzip or zstd (known
// by its first bytes, whatever its name) is decompressed as it is read.
//
// Documents:
//   a text file     is one document, in any encoding (UTF-8, Latin-1, ...), taken as it is. A file
//                   whose first block holds a NUL byte is skipped as binary, as is an empty one.
//   a JSONL file    (`.jsonl` or `.ndjson`, before any `.gz`/`.zst`) holds one document per line:
//                   the string under `jsonl_field` of the line's object. A line that is not such
//                   an object is refused, naming its file and line, or skipped and counted
//                   (BadLines::Skip). Blank lines are ignored.
// A document longer than kPieceBytes reaches the tokenizer in pieces cut after a line end.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace moetrain {

enum class BadLines { Refuse, Skip };

struct CorpusOptions {
  std::vector<std::filesystem::path> inputs;  // files or directories
  std::string jsonl_field = "text";
  BadLines bad_lines = BadLines::Refuse;
  std::vector<std::filesystem::path> exclude;  // never read (the outputs of the reading command)
};

struct CorpusSkipped {
  std::string path;
  std::string reason;
  uint64_t bytes = 0;
};

struct CorpusFile {
  std::filesystem::path path;
  uint64_t bytes = 0;  // on disk
  bool jsonl = false;
};

// The files a corpus reads, in order, and those left out with the reason.
struct CorpusScan {
  std::vector<CorpusFile> files;
  std::vector<CorpusSkipped> skipped;
  uint64_t bytes = 0;  // on disk, of `files`
};

// Throws Error for a missing input or one that is neither a file nor a directory.
CorpusScan scan_corpus(const CorpusOptions& options);

constexpr std::size_t kPieceBytes = std::size_t{1} << 20;

struct TextPiece {
  std::string text;
  bool end_of_document = false;
};

// What a corpus held, file by file, once read.
struct CorpusSource {
  std::string path;
  uint64_t bytes = 0;  // of text (decompressed), documents' contents only
  uint64_t documents = 0;
  uint64_t bad_lines = 0;  // JSONL lines skipped (BadLines::Skip)
};

// Streams the documents of a scan, in order.
class CorpusReader {
 public:
  CorpusReader(const CorpusScan& scan, const CorpusOptions& options);
  ~CorpusReader();
  // The next piece of text; false at the end. Throws naming the file (and line) on a read error,
  // a bad JSONL line under BadLines::Refuse, or a NUL byte past a text file's first block.
  bool next(TextPiece& piece);
  // On-disk bytes consumed so far (compressed bytes for compressed files): progress.
  uint64_t bytes_consumed() const;
  const std::vector<CorpusSource>& sources() const { return sources_; }
  // Files found empty or binary while reading (scan_corpus does not open files).
  const std::vector<CorpusSkipped>& skipped() const { return skipped_; }

 private:
  struct Stream;
  bool open_next_file();
  bool next_text(TextPiece& piece);
  bool next_jsonl(TextPiece& piece);

  const CorpusScan& scan_;
  CorpusOptions options_;
  std::size_t file_ = 0;
  uint64_t done_bytes_ = 0;  // on-disk bytes of the files finished
  std::unique_ptr<Stream> in_;
  std::string buf_;        // read; [pos_, end) not yet handed out
  std::size_t pos_ = 0;
  uint64_t offset_ = 0;    // decompressed offset of buf_'s start in the current file
  uint64_t line_ = 0;      // JSONL: lines consumed
  bool eof_ = false;
  std::vector<CorpusSource> sources_;
  std::vector<CorpusSkipped> skipped_;
  std::vector<TextPiece> pending_;
};

}  // namespace moetrain
