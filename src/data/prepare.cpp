#include "data/prepare.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string_view>
#include <system_error>

#include "core/check.h"
#include "core/log.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "io/file.h"

namespace moetrain {

namespace fs = std::filesystem;

namespace {

constexpr uint64_t kMaxChunkBytes = 8192;
constexpr uint64_t kTargetValChunks = 16;

std::string read_whole_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  MOETRAIN_CHECK(f.good(), "prepare: cannot open input file '{}'", p.string());
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  MOETRAIN_CHECK(!f.bad(), "prepare: error reading '{}'", p.string());
  return s;
}

uint64_t file_size_or_zero(const fs::path& p) {
  std::error_code ec;
  auto n = fs::file_size(p, ec);
  return ec ? 0 : static_cast<uint64_t>(n);
}

// Regular files under `dir` in path order; symlinks, `.dat` indexes and special files go to
// `skipped`. Symlinked directories are not followed (they would duplicate or loop).
void collect_directory(const fs::path& dir, std::vector<fs::path>& files,
                       std::vector<PrepareSkipped>& skipped) {
  std::vector<fs::path> found;
  std::vector<PrepareSkipped> dropped;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, ec), end;
  MOETRAIN_CHECK(!ec, "prepare: cannot list directory '{}': {}", dir.string(), ec.message());
  for (; it != end; it.increment(ec)) {
    MOETRAIN_CHECK(!ec, "prepare: cannot list directory '{}': {}", dir.string(), ec.message());
    const fs::path& p = it->path();
    const auto st = it->symlink_status(ec);
    MOETRAIN_CHECK(!ec, "prepare: cannot stat '{}': {}", p.string(), ec.message());
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

// ": 3 symlink, 1 binary" — how many files were skipped for each kind of reason (the words
// before a reason's ':'); "" when none were. meta.json lists each with its full reason.
std::string skip_reasons(const std::vector<PrepareSkipped>& skipped) {
  std::vector<std::pair<std::string, int>> kinds;
  for (const auto& s : skipped) {
    const std::string kind = s.reason.substr(0, s.reason.find(':'));
    auto it =
        std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == kind; });
    if (it == kinds.end())
      kinds.emplace_back(kind, 1);
    else
      ++it->second;
  }
  std::string out;
  for (const auto& [kind, n] : kinds)
    out += fmt::format("{}{} {}", out.empty() ? ": " : ", ", n, kind);
  return out;
}

void ensure_writable_dir(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  MOETRAIN_CHECK(!ec, "prepare: cannot create output directory '{}': {}", dir.string(),
                 ec.message());
  MOETRAIN_CHECK(fs::is_directory(dir, ec), "prepare: output path '{}' is not a directory",
                 dir.string());
  MOETRAIN_CHECK(::access(dir.c_str(), W_OK | X_OK) == 0,
                 "prepare: output directory '{}' is not writable", dir.string());
}

}  // namespace

uint64_t split_chunk_bytes(uint64_t total, double val_fraction) {
  if (!(val_fraction > 0)) return kMaxChunkBytes;
  const double c = std::floor(static_cast<double>(total) * val_fraction / kTargetValChunks);
  return static_cast<uint64_t>(std::clamp(c, 1.0, static_cast<double>(kMaxChunkBytes)));
}

bool is_val_chunk(uint64_t chunk, double val_fraction) {
  const double i = static_cast<double>(chunk);
  return std::floor((i + 1) * val_fraction) > std::floor(i * val_fraction);
}

PrepareReport prepare_text_corpus(const PrepareOptions& options) {
  const double f = options.val_fraction;
  MOETRAIN_CHECK(std::isfinite(f) && f >= 0 && f < 1, "prepare: val fraction {} outside [0, 1)", f);
  MOETRAIN_CHECK(!options.inputs.empty(), "prepare: no input files or directories given");
  MOETRAIN_CHECK(!options.out_dir.empty(), "prepare: no output directory given");

  PrepareReport report;
  std::vector<fs::path> candidates;
  for (const auto& input : options.inputs) {
    std::error_code ec;
    const auto st = fs::status(input, ec);
    MOETRAIN_CHECK(fs::exists(st), "prepare: input '{}' does not exist", input.string());
    if (fs::is_directory(st)) {
      collect_directory(input, candidates, report.skipped);
    } else {
      MOETRAIN_CHECK(fs::is_regular_file(st),
                     "prepare: input '{}' is neither a regular file nor a directory",
                     input.string());
      candidates.push_back(input);
    }
  }

  // Prepared into one of its own inputs, a second run would ingest the first's meta.json.
  std::vector<fs::path> outputs;
  for (const char* name : {"train.bin", "val.bin", "meta.json"})
    outputs.push_back(fs::weakly_canonical(options.out_dir / name));
  std::string corpus;
  for (const auto& p : candidates) {
    if (std::find(outputs.begin(), outputs.end(), fs::weakly_canonical(p)) != outputs.end()) {
      report.skipped.push_back({p.string(), "an output of this prepare", file_size_or_zero(p)});
      continue;
    }
    std::string text = read_whole_file(p);
    std::string reason;
    if (text.empty()) {
      reason = "empty";
    } else if (auto nul = text.find('\0'); nul != std::string::npos) {
      // Text in any encoding (UTF-8, Latin-1, ...) has no NUL; compressed and binary files do.
      reason = fmt::format("binary: NUL byte at offset {}", nul);
    }
    if (!reason.empty()) {
      report.skipped.push_back({p.string(), reason, text.size()});
      continue;
    }
    if (!corpus.empty()) corpus += '\n';
    corpus += text;
    report.sources.push_back({p.string(), text.size()});
    report.bytes_taken += text.size();
  }
  for (const auto& s : report.skipped) {
    report.bytes_skipped += s.bytes;
    log_debug("prepare: skipped {} ({})", s.path, s.reason);
  }
  MOETRAIN_CHECK(!corpus.empty(), "prepare: the inputs hold no text ({} files taken, {} skipped)",
                 report.sources.size(), report.skipped.size());
  ensure_writable_dir(options.out_dir);

  const uint64_t total = corpus.size();
  report.chunk_bytes = split_chunk_bytes(total, f);
  std::vector<uint16_t> train, val;
  train.reserve(total);
  for (uint64_t begin = 0, chunk = 0; begin < total; begin += report.chunk_bytes, ++chunk) {
    const uint64_t len = std::min(report.chunk_bytes, total - begin);
    auto& dst = is_val_chunk(chunk, f) ? val : train;
    const std::size_t at = dst.size();
    dst.resize(at + len);
    byte_encode(std::string_view(corpus).substr(begin, len), dst.data() + at);
  }
  report.train_tokens = train.size();
  report.val_tokens = val.size();
  if (f > 0 && val.empty())
    log_warn("prepare: corpus of {} bytes too small for a val split at {}", total, f);

  write_token_shard(options.out_dir / "train.bin", train.data(), train.size(), kByteVocab);
  write_token_shard(options.out_dir / "val.bin", val.data(), val.size(), kByteVocab);

  nlohmann::ordered_json meta;
  meta["format"] = "MOETOK01";
  meta["tokenizer"] = "byte";
  meta["vocab_size"] = kByteVocab;
  meta["train_tokens"] = report.train_tokens;
  meta["val_tokens"] = report.val_tokens;
  meta["val_fraction"] = f;
  meta["split"] = {
      {"rule", "chunk i of the '\\n'-joined stream is val iff floor((i+1)*f) > floor(i*f)"},
      {"chunk_bytes", report.chunk_bytes}};
  meta["bytes_taken"] = report.bytes_taken;
  meta["bytes_skipped"] = report.bytes_skipped;
  auto& sources = meta["sources"] = nlohmann::ordered_json::array();
  for (const auto& s : report.sources) sources.push_back({{"path", s.path}, {"bytes", s.bytes}});
  auto& skipped = meta["skipped"] = nlohmann::ordered_json::array();
  for (const auto& s : report.skipped)
    skipped.push_back({{"path", s.path}, {"reason", s.reason}, {"bytes", s.bytes}});
  // Written last: a meta.json means both shards are complete. Non-UTF-8 file names are replaced,
  // not fatal.
  write_file_atomic(
      options.out_dir / "meta.json",
      meta.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n");

  log_info(
      "prepare: took {} files ({} bytes), skipped {} files ({} bytes{}); train {} tokens, val {} "
      "tokens -> {}",
      report.sources.size(), report.bytes_taken, report.skipped.size(), report.bytes_skipped,
      skip_reasons(report.skipped), report.train_tokens, report.val_tokens,
      options.out_dir.string());
  return report;
}

}  // namespace moetrain
