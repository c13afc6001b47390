#include "data/corpus.h"

#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <system_error>

#include "core/check.h"
#include "core/log.h"

namespace moetrain {

namespace fs = std::filesystem;

namespace {

constexpr std::size_t kReadBytes = std::size_t{1} << 20;

uint64_t file_size_or_zero(const fs::path& p) {
  std::error_code ec;
  auto n = fs::file_size(p, ec);
  return ec ? 0 : static_cast<uint64_t>(n);
}

// "a.jsonl", "a.jsonl.gz", "a.ndjson.zst": one document per line.
bool is_jsonl_name(const fs::path& p) {
  fs::path q = p;
  const auto ext = q.extension();
  if (ext == ".gz" || ext == ".zst" || ext == ".zstd") q = q.stem();
  return q.extension() == ".jsonl" || q.extension() == ".ndjson";
}

// Regular files under `dir` in path order; symlinks, `.dat` indexes and special files go to
// `skipped`. Symlinked directories are not followed (they would duplicate or loop).
void collect_directory(const fs::path& dir, std::vector<fs::path>& files,
                       std::vector<CorpusSkipped>& skipped) {
  std::vector<fs::path> found;
  std::vector<CorpusSkipped> dropped;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, ec), end;
  MOETRAIN_CHECK(!ec, "cannot list directory '{}': {}", dir.string(), ec.message());
  for (; it != end; it.increment(ec)) {
    MOETRAIN_CHECK(!ec, "cannot list directory '{}': {}", dir.string(), ec.message());
    const fs::path& p = it->path();
    const auto st = it->symlink_status(ec);
    MOETRAIN_CHECK(!ec, "cannot stat '{}': {}", p.string(), ec.message());
    if (fs::is_symlink(st)) {
      dropped.push_back({p.string(), "symlink", 0});
    } else if (fs::is_directory(st)) {
      continue;
    } else if (!fs::is_regular_file(st)) {
      dropped.push_back({p.string(), "not a regular file", 0});
    } else if (p.extension() == ".dat") {
      dropped.push_back({p.string(), "index file (.dat)", file_size_or_zero(p)});
    } else {
      found.push_back(p);
    }
  }
  std::sort(found.begin(), found.end());
  std::sort(dropped.begin(), dropped.end(),
            [](const auto& a, const auto& b) { return a.path < b.path; });
  files.insert(files.end(), found.begin(), found.end());
  skipped.insert(skipped.end(), dropped.begin(), dropped.end());
}

// How much of `text` (longer than kPieceBytes) the next piece takes: up to the last line end in
// its first kPieceBytes, or else kPieceBytes backed off to a UTF-8 character boundary.
std::size_t piece_length(std::string_view text) {
  const std::size_t nl = text.substr(0, kPieceBytes).rfind('\n');
  if (nl != std::string_view::npos) return nl + 1;
  std::size_t take = kPieceBytes;
  while (take > 1 && (static_cast<unsigned char>(text[take]) & 0xC0) == 0x80) --take;
  return take;
}

}  // namespace

CorpusScan scan_corpus(const CorpusOptions& options) {
  MOETRAIN_CHECK(!options.inputs.empty(), "no input files or directories given");
  CorpusScan scan;
  std::vector<fs::path> candidates;
  for (const auto& input : options.inputs) {
    std::error_code ec;
    const auto st = fs::status(input, ec);
    MOETRAIN_CHECK(fs::exists(st), "input '{}' does not exist", input.string());
    if (fs::is_directory(st)) {
      collect_directory(input, candidates, scan.skipped);
    } else {
      MOETRAIN_CHECK(fs::is_regular_file(st), "input '{}' is neither a regular file nor a directory",
                     input.string());
      candidates.push_back(input);
    }
  }
  std::vector<fs::path> exclude;
  for (const auto& p : options.exclude) exclude.push_back(fs::weakly_canonical(p));
  for (const auto& p : candidates) {
    const uint64_t bytes = file_size_or_zero(p);
    if (std::find(exclude.begin(), exclude.end(), fs::weakly_canonical(p)) != exclude.end()) {
      // Prepared into one of its own inputs, a second run would ingest the first's outputs.
      scan.skipped.push_back({p.string(), "an output of this command", bytes});
      continue;
    }
    scan.files.push_back({p, bytes, is_jsonl_name(p)});
    scan.bytes += bytes;
  }
  return scan;
}

// A file's bytes, decompressed: zstd by its magic number, anything else through zlib's gz reader
// (which reads gzip and passes other files through unchanged).
struct CorpusReader::Stream {
  fs::path path;
  gzFile gz = nullptr;
  std::FILE* file = nullptr;  // zstd
  ZSTD_DStream* zstd = nullptr;
  std::vector<char> zin;
  ZSTD_inBuffer in{nullptr, 0, 0};
  uint64_t consumed = 0;  // zstd: compressed bytes read
  bool zstd_frame_open = false;

  explicit Stream(fs::path p) : path(std::move(p)) {
    unsigned char magic[4] = {0, 0, 0, 0};
    {
      std::FILE* f = std::fopen(path.c_str(), "rb");
      MOETRAIN_CHECK(f != nullptr, "cannot open '{}': {}", path.string(), std::strerror(errno));
      const std::size_t n = std::fread(magic, 1, 4, f);
      std::fclose(f);
      if (n == 4 && magic[0] == 0x28 && magic[1] == 0xb5 && magic[2] == 0x2f && magic[3] == 0xfd) {
        file = std::fopen(path.c_str(), "rb");
        MOETRAIN_CHECK(file != nullptr, "cannot open '{}': {}", path.string(),
                       std::strerror(errno));
        zstd = ZSTD_createDStream();
        MOETRAIN_CHECK(zstd != nullptr, "'{}': cannot create a zstd decoder", path.string());
        zin.resize(ZSTD_DStreamInSize());
        return;
      }
    }
    gz = gzopen(path.c_str(), "rb");
    MOETRAIN_CHECK(gz != nullptr, "cannot open '{}': {}", path.string(), std::strerror(errno));
    gzbuffer(gz, 1 << 17);
  }
  ~Stream() {
    if (gz) gzclose(gz);
    if (zstd) ZSTD_freeDStream(zstd);
    if (file) std::fclose(file);
  }
  // Up to n bytes into dst; 0 at the end.
  std::size_t read(char* dst, std::size_t n) {
    if (gz) {
      const int got = gzread(gz, dst, static_cast<unsigned>(n));
      if (got < 0) {
        int err = 0;
        const char* msg = gzerror(gz, &err);
        MOETRAIN_FAIL("'{}': cannot read ({}; a damaged or truncated gzip file?)", path.string(),
                      msg);
      }
      return static_cast<std::size_t>(got);
    }
    ZSTD_outBuffer out{dst, n, 0};
    while (out.pos == 0) {
      if (in.pos == in.size) {
        const std::size_t got = std::fread(zin.data(), 1, zin.size(), file);
        MOETRAIN_CHECK(!std::ferror(file), "'{}': read error", path.string());
        if (got == 0) {
          MOETRAIN_CHECK(!zstd_frame_open, "'{}': truncated zstd file (the last frame is cut off)",
                         path.string());
          return 0;
        }
        consumed += got;
        in = {zin.data(), got, 0};
      }
      const std::size_t r = ZSTD_decompressStream(zstd, &out, &in);
      MOETRAIN_CHECK(!ZSTD_isError(r), "'{}': cannot decompress: {}", path.string(),
                     ZSTD_getErrorName(r));
      zstd_frame_open = r != 0;
    }
    return out.pos;
  }
  // Appends one block to buf; false at the end of the file.
  bool fill(std::string& buf, bool& eof) {
    if (eof) return false;
    const std::size_t at = buf.size();
    buf.resize(at + kReadBytes);
    const std::size_t got = read(buf.data() + at, kReadBytes);
    buf.resize(at + got);
    if (got == 0) eof = true;
    return got > 0;
  }
  uint64_t offset() const { return gz ? static_cast<uint64_t>(std::max<long>(gzoffset(gz), 0)) : consumed; }
};

CorpusReader::CorpusReader(const CorpusScan& scan, const CorpusOptions& options)
    : scan_(scan), options_(options) {}

CorpusReader::~CorpusReader() = default;

uint64_t CorpusReader::bytes_consumed() const {
  return done_bytes_ + (in_ ? std::min(in_->offset(), scan_.files[file_].bytes) : 0);
}

bool CorpusReader::open_next_file() {
  while (file_ < scan_.files.size()) {
    const CorpusFile& f = scan_.files[file_];
    in_ = std::make_unique<Stream>(f.path);
    buf_.clear();
    pos_ = 0;
    offset_ = 0;
    line_ = 0;
    eof_ = false;
    while (buf_.size() < kReadBytes && in_->fill(buf_, eof_)) {
    }
    std::string reason;
    if (buf_.empty()) {
      reason = "empty";
    } else if (auto nul = buf_.find('\0'); nul != std::string::npos && !f.jsonl) {
      // Text in any encoding (UTF-8, Latin-1, ...) has no NUL; binary files do.
      reason = fmt::format("binary: NUL byte at offset {}", nul);
    }
    if (reason.empty()) {
      sources_.push_back({f.path.string(), 0, 0, 0});
      return true;
    }
    skipped_.push_back({f.path.string(), reason, f.bytes});
    log_debug("skipped {} ({})", f.path.string(), reason);
    in_.reset();
    done_bytes_ += f.bytes;
    ++file_;
  }
  return false;
}

bool CorpusReader::next_text(TextPiece& piece) {
  const CorpusFile& f = scan_.files[file_];
  while (buf_.size() - pos_ <= kPieceBytes && !eof_) {
    const std::size_t before = buf_.size();
    in_->fill(buf_, eof_);
    if (auto nul = buf_.find('\0', before); nul != std::string::npos)
      MOETRAIN_FAIL("'{}': NUL byte at offset {} in a text file (binary data after the first {} "
                    "bytes); remove the file from the inputs",
                    f.path.string(), offset_ + (nul - pos_), kReadBytes);
  }
  const std::size_t left = buf_.size() - pos_;
  const std::size_t take =
      left > kPieceBytes ? piece_length(std::string_view(buf_).substr(pos_)) : left;
  piece.text.assign(buf_, pos_, take);
  piece.end_of_document = take == left && eof_;
  pos_ += take;
  offset_ += take;
  sources_.back().bytes += take;
  if (pos_ > kReadBytes) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  if (piece.end_of_document) sources_.back().documents = 1;
  return true;
}

bool CorpusReader::next_jsonl(TextPiece& piece) {
  const CorpusFile& f = scan_.files[file_];
  for (;;) {
    std::size_t nl = buf_.find('\n', pos_);
    while (nl == std::string::npos && in_->fill(buf_, eof_)) nl = buf_.find('\n', pos_);
    if (nl == std::string::npos && pos_ == buf_.size()) return false;  // end of file
    const std::size_t end = nl == std::string::npos ? buf_.size() : nl;
    std::string_view line(buf_.data() + pos_, end - pos_);
    pos_ = nl == std::string::npos ? buf_.size() : nl + 1;
    ++line_;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    std::string problem;
    std::string text;
    try {
      const auto j = nlohmann::json::parse(line);
      if (!j.is_object()) {
        problem = fmt::format("a JSON {}, not an object", j.type_name());
      } else if (auto it = j.find(options_.jsonl_field); it == j.end()) {
        problem = fmt::format("no field \"{}\" (--jsonl-field)", options_.jsonl_field);
      } else if (!it->is_string()) {
        problem = fmt::format("field \"{}\" is a {}, not a string", options_.jsonl_field,
                              it->type_name());
      } else {
        text = it->get<std::string>();
      }
    } catch (const nlohmann::json::exception& e) {
      problem = fmt::format("not valid JSON ({})", e.what());
    }
    if (pos_ > kReadBytes) {
      buf_.erase(0, pos_);
      pos_ = 0;
    }
    if (!problem.empty()) {
      MOETRAIN_CHECK(options_.bad_lines == BadLines::Skip,
                     "{}:{}: {}; fix the line, or pass --bad-lines skip to skip such lines",
                     f.path.string(), line_, problem);
      if (sources_.back().bad_lines < 10)
        log_warn("{}:{}: {}; skipped (--bad-lines skip)", f.path.string(), line_, problem);
      ++sources_.back().bad_lines;
      continue;
    }
    if (text.empty()) continue;
    sources_.back().bytes += text.size();
    ++sources_.back().documents;
    // A long document goes on in pieces cut after a line end.
    std::size_t at = 0;
    while (text.size() - at > kPieceBytes) {
      const std::size_t cut = piece_length(std::string_view(text).substr(at));
      pending_.push_back({text.substr(at, cut), false});
      at += cut;
    }
    pending_.push_back({text.substr(at), true});
    std::reverse(pending_.begin(), pending_.end());
    piece = std::move(pending_.back());
    pending_.pop_back();
    return true;
  }
}

bool CorpusReader::next(TextPiece& piece) {
  if (!pending_.empty()) {
    piece = std::move(pending_.back());
    pending_.pop_back();
    return true;
  }
  for (;;) {
    if (!in_) {
      if (!open_next_file()) return false;
    }
    const bool jsonl = scan_.files[file_].jsonl;
    if (jsonl ? next_jsonl(piece) : next_text(piece)) {
      if (!jsonl && piece.end_of_document) {
        in_.reset();
        done_bytes_ += scan_.files[file_].bytes;
        ++file_;
      }
      return true;
    }
    in_.reset();
    done_bytes_ += scan_.files[file_].bytes;
    ++file_;
  }
}

}  // namespace moetrain
