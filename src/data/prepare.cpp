#include "data/prepare.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <system_error>

#include "core/check.h"
#include "core/log.h"
#include "data/shard.h"
#include "io/file.h"

namespace moetrain {

namespace fs = std::filesystem;

namespace {

constexpr uint64_t kMaxChunkTokens = 8192;
constexpr uint64_t kTargetValChunks = 16;

// ": 3 symlink, 1 binary" — how many files were skipped for each kind of reason (the words
// before a reason's ':'); "" when none were. meta.json lists each with its full reason.
std::string skip_reasons(const std::vector<CorpusSkipped>& skipped) {
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

// The token stream between reading and splitting: int32 ids in a file, removed when done.
class TokenSpill {
 public:
  explicit TokenSpill(fs::path path) : path_(std::move(path)) {
    f_ = std::fopen(path_.c_str(), "w+b");
    MOETRAIN_CHECK(f_ != nullptr, "prepare: cannot create '{}': {}", path_.string(),
                   std::strerror(errno));
  }
  ~TokenSpill() {
    if (f_) std::fclose(f_);
    std::error_code ec;
    fs::remove(path_, ec);
  }
  void append(const std::vector<int32_t>& t) {
    if (t.empty()) return;
    MOETRAIN_CHECK(std::fwrite(t.data(), sizeof(int32_t), t.size(), f_) == t.size(),
                   "prepare: cannot write '{}' (disk full?)", path_.string());
    count_ += t.size();
  }
  uint64_t count() const { return count_; }
  void rewind() {
    MOETRAIN_CHECK(std::fflush(f_) == 0 && std::fseek(f_, 0, SEEK_SET) == 0,
                   "prepare: cannot reread '{}'", path_.string());
  }
  void read(int32_t* out, std::size_t n) {
    MOETRAIN_CHECK(std::fread(out, sizeof(int32_t), n, f_) == n, "prepare: cannot reread '{}'",
                   path_.string());
  }

 private:
  fs::path path_;
  std::FILE* f_ = nullptr;
  uint64_t count_ = 0;
};

class ProgressBar {
 public:
  ProgressBar(bool on, uint64_t total) : on_(on && ::isatty(2)), total_(total) {}
  void update(uint64_t done, uint64_t tokens) {
    if (!on_) return;
    const double s = std::chrono::duration<double>(Clock::now() - start_).count();
    const double frac = total_ ? std::min(1.0, static_cast<double>(done) / total_) : 1.0;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(frac * kWidth);
    std::fprintf(stderr, "\rprepare [%s%s] %5.1f%%  %.1f of %.1f MB, %llu tokens, %.1f MB/s ",
                 std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
                 100 * frac, done / 1e6, total_ / 1e6, static_cast<unsigned long long>(tokens),
                 s > 0 ? done / 1e6 / s : 0.0);
    std::fflush(stderr);
    drawn_ = true;
  }
  ~ProgressBar() {
    if (drawn_) std::fputc('\n', stderr);
  }

 private:
  using Clock = std::chrono::steady_clock;
  bool on_;
  uint64_t total_;
  Clock::time_point start_ = Clock::now();
  bool drawn_ = false;
};

// Encodes a batch of pieces in parallel, each followed by the end-of-document token when it ends
// one: their tokens, piece by piece.
std::vector<std::vector<int32_t>> encode_batch(const Tokenizer& tok, const std::vector<TextPiece>& batch) {
  std::vector<std::vector<int32_t>> out(batch.size());
  const int32_t eod = tok.eod_id();
  const auto n = static_cast<int64_t>(batch.size());
  std::string error;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    try {
      tok.encode_into(batch[i].text, out[i]);
      if (batch[i].end_of_document) out[i].push_back(eod);
    } catch (const std::exception& e) {
#pragma omp critical
      error = e.what();
    }
  }
  MOETRAIN_CHECK(error.empty(), "prepare: {}", error);
  return out;
}

}  // namespace

uint64_t split_chunk_tokens(uint64_t total, double val_fraction) {
  if (!(val_fraction > 0)) return kMaxChunkTokens;
  const double c = std::floor(static_cast<double>(total) * val_fraction / kTargetValChunks);
  return static_cast<uint64_t>(std::clamp(c, 1.0, static_cast<double>(kMaxChunkTokens)));
}

bool is_val_chunk(uint64_t chunk, double val_fraction) {
  const double i = static_cast<double>(chunk);
  return std::floor((i + 1) * val_fraction) > std::floor(i * val_fraction);
}

PrepareReport prepare_corpus(const PrepareOptions& options) {
  const double f = options.val_fraction;
  MOETRAIN_CHECK(std::isfinite(f) && f >= 0 && f < 1, "prepare: val fraction {} outside [0, 1)", f);
  MOETRAIN_CHECK(!options.inputs.empty(), "prepare: no input files or directories given");
  MOETRAIN_CHECK(!options.out_dir.empty(), "prepare: no output directory given");
  const Tokenizer& tok = options.tokenizer;
  const auto V = static_cast<uint64_t>(tok.vocab_size());

  CorpusOptions copt;
  copt.inputs = options.inputs;
  copt.jsonl_field = options.jsonl_field;
  copt.bad_lines = options.bad_lines;
  for (const char* name : {"train.bin", "val.bin", "meta.json", kTokenizerFile})
    copt.exclude.push_back(options.out_dir / name);
  const CorpusScan scan = scan_corpus(copt);
  ensure_writable_dir(options.out_dir);

  PrepareReport report;
  TokenSpill spill(options.out_dir / fmt::format(".prepare-{}.tokens", ::getpid()));
  CorpusReader reader(scan, copt);
  {
    ProgressBar bar(options.progress, scan.bytes);
    std::vector<TextPiece> batch;
    std::size_t batch_bytes = 0;
    auto flush = [&] {
      for (const auto& tokens : encode_batch(tok, batch)) spill.append(tokens);
      batch.clear();
      batch_bytes = 0;
      bar.update(reader.bytes_consumed(), spill.count());
    };
    for (TextPiece piece; reader.next(piece);) {
      batch_bytes += piece.text.size();
      batch.push_back(std::move(piece));
      piece = TextPiece();
      if (batch_bytes >= options.batch_bytes) flush();
    }
    flush();
  }
  report.sources = reader.sources();
  report.skipped = scan.skipped;
  report.skipped.insert(report.skipped.end(), reader.skipped().begin(), reader.skipped().end());
  for (const auto& s : report.sources) {
    report.bytes_taken += s.bytes;
    report.documents += s.documents;
    report.bad_lines += s.bad_lines;
  }
  for (const auto& s : report.skipped) report.bytes_skipped += s.bytes;
  std::string inputs;
  for (const auto& p : options.inputs) inputs += (inputs.empty() ? "" : ", ") + p.string();
  MOETRAIN_CHECK(report.documents > 0 && spill.count() > 0,
                 "prepare: the inputs ({}) hold no text: {} files read, {} skipped{}", inputs,
                 report.sources.size(), report.skipped.size(), skip_reasons(report.skipped));

  // Split the stream; the counts first, for the shards' headers.
  const uint64_t total = spill.count();
  report.chunk_tokens = split_chunk_tokens(total, f);
  const uint64_t chunks = (total + report.chunk_tokens - 1) / report.chunk_tokens;
  for (uint64_t c = 0; c < chunks; ++c) {
    const uint64_t len = std::min(report.chunk_tokens, total - c * report.chunk_tokens);
    (is_val_chunk(c, f) ? report.val_tokens : report.train_tokens) += len;
  }
  if (f > 0 && report.val_tokens == 0)
    log_warn("prepare: corpus of {} tokens too small for a val split at {}", total, f);
  {
    TokenShardWriter train(options.out_dir / "train.bin", static_cast<uint32_t>(V),
                           report.train_tokens);
    TokenShardWriter val(options.out_dir / "val.bin", static_cast<uint32_t>(V), report.val_tokens);
    spill.rewind();
    std::vector<int32_t> buf;
    const uint64_t per_read = std::max<uint64_t>(1, (uint64_t{1} << 20) / report.chunk_tokens);
    for (uint64_t c = 0; c < chunks; c += per_read) {
      const uint64_t n_chunks = std::min(per_read, chunks - c);
      const uint64_t begin = c * report.chunk_tokens;
      const uint64_t n = std::min(n_chunks * report.chunk_tokens, total - begin);
      buf.resize(n);
      spill.read(buf.data(), n);
      for (uint64_t k = 0; k < n_chunks; ++k) {
        const uint64_t at = k * report.chunk_tokens;
        const uint64_t len = std::min(report.chunk_tokens, n - at);
        (is_val_chunk(c + k, f) ? val : train).append({buf.data() + at, len});
      }
    }
    train.commit();
    val.commit();
  }
  if (!tok.is_bytes()) {
    write_file_atomic(options.out_dir / kTokenizerFile, tok.model_bytes());
  } else {
    std::error_code ec;  // an earlier prepare's model would contradict meta.json
    fs::remove(options.out_dir / kTokenizerFile, ec);
  }

  nlohmann::ordered_json meta;
  meta["format"] = "MOETOK01";
  meta["tokenizer"] = {{"kind", tok.kind()},
                       {"vocab_size", V},
                       {"fingerprint", tok.fingerprint()},
                       {"end_of_document", tok.eod_id()}};
  if (!tok.is_bytes()) meta["tokenizer"]["file"] = kTokenizerFile;
  meta["vocab_size"] = V;
  meta["token_bytes"] = shard_token_bytes(V);
  meta["train_tokens"] = report.train_tokens;
  meta["val_tokens"] = report.val_tokens;
  meta["val_fraction"] = f;
  meta["split"] = {
      {"rule", "chunk i of the token stream is val iff floor((i+1)*f) > floor(i*f)"},
      {"chunk_tokens", report.chunk_tokens}};
  meta["documents"] = report.documents;
  meta["bytes_taken"] = report.bytes_taken;
  meta["bytes_skipped"] = report.bytes_skipped;
  meta["jsonl_field"] = options.jsonl_field;
  meta["bad_lines_skipped"] = report.bad_lines;
  auto& sources = meta["sources"] = nlohmann::ordered_json::array();
  for (const auto& s : report.sources)
    sources.push_back({{"path", s.path},
                       {"bytes", s.bytes},
                       {"documents", s.documents},
                       {"bad_lines", s.bad_lines}});
  auto& skipped = meta["skipped"] = nlohmann::ordered_json::array();
  for (const auto& s : report.skipped)
    skipped.push_back({{"path", s.path}, {"reason", s.reason}, {"bytes", s.bytes}});
  // Written last: a meta.json means both shards are complete. Non-UTF-8 file names are replaced,
  // not fatal.
  write_file_atomic(
      options.out_dir / "meta.json",
      meta.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n");

  log_info(
      "prepare: took {} files ({} bytes, {} documents), skipped {} files ({} bytes{}){}; {} "
      "tokenizer ({} tokens); train {} tokens, val {} tokens -> {}",
      report.sources.size(), report.bytes_taken, report.documents, report.skipped.size(),
      report.bytes_skipped, skip_reasons(report.skipped),
      report.bad_lines ? fmt::format(", {} bad JSONL lines skipped", report.bad_lines) : "",
      tok.kind(), V, report.train_tokens, report.val_tokens, options.out_dir.string());
  return report;
}

}  // namespace moetrain
