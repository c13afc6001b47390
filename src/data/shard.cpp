#include "data/shard.h"

#include <cstring>

#include "core/check.h"

namespace moetrain {

namespace {
struct ShardHeader {
  char magic[8];
  uint32_t version;
  uint32_t vocab;
  uint64_t count;
};
static_assert(sizeof(ShardHeader) == kShardHeaderBytes);
}  // namespace

namespace {
uint32_t version_for(uint32_t vocab) {
  return vocab <= kShardMaxVocab16 ? 1 : 2;
}
}  // namespace

TokenShardWriter::TokenShardWriter(const std::filesystem::path& path, uint32_t vocab,
                                   uint64_t count)
    : out_(path), vocab_(vocab), count_(count) {
  MOETRAIN_CHECK(vocab >= 1 && vocab <= kShardMaxVocab,
                 "token shard '{}': vocab size {} outside [1, {}]", path.string(), vocab,
                 kShardMaxVocab);
  ShardHeader h{};
  std::memcpy(h.magic, kShardMagic, 8);
  h.version = version_for(vocab);
  h.vocab = vocab;
  h.count = count;
  out_.write(&h, sizeof(h));
}

void TokenShardWriter::append(std::span<const int32_t> tokens) {
  MOETRAIN_CHECK(tokens.size() <= count_ - written_,
                 "token shard '{}': more than the {} tokens its header announces",
                 out_.path().string(), count_);
  const std::size_t w = shard_token_bytes(vocab_);
  buf_.resize(tokens.size() * w);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    MOETRAIN_CHECK(t >= 0 && static_cast<uint32_t>(t) < vocab_,
                   "token shard '{}': token {} at position {} is not below the vocab size {}",
                   out_.path().string(), t, written_ + i, vocab_);
    if (w == 2) {
      const uint16_t v = static_cast<uint16_t>(t);
      std::memcpy(buf_.data() + i * 2, &v, 2);
    } else {
      const uint32_t v = static_cast<uint32_t>(t);
      std::memcpy(buf_.data() + i * 4, &v, 4);
    }
  }
  if (!buf_.empty()) out_.write(buf_.data(), buf_.size());
  written_ += tokens.size();
}

void TokenShardWriter::commit() {
  MOETRAIN_CHECK(written_ == count_, "token shard '{}': {} tokens written, the header announces {}",
                 out_.path().string(), written_, count_);
  out_.commit();
}

void write_token_shard(const std::filesystem::path& path, std::span<const int32_t> tokens,
                       uint32_t vocab) {
  TokenShardWriter w(path, vocab, tokens.size());
  w.append(tokens);
  w.commit();
}

void write_token_shard(const std::filesystem::path& path, const uint16_t* tokens, uint64_t n,
                       uint32_t vocab) {
  MOETRAIN_CHECK(tokens != nullptr || n == 0, "token shard '{}': null tokens for {} tokens",
                 path.string(), n);
  std::vector<int32_t> wide(tokens, tokens + n);
  write_token_shard(path, wide, vocab);
}

TokenShard::TokenShard(const std::filesystem::path& path) : file_(path) {
  const std::string name = path.string();
  const uint64_t bytes = file_.size();
  MOETRAIN_CHECK(bytes >= kShardHeaderBytes,
                 "token shard '{}': {} bytes, shorter than the {}-byte header", name, bytes,
                 kShardHeaderBytes);
  ShardHeader h;
  std::memcpy(&h, file_.data(), sizeof(h));
  MOETRAIN_CHECK(std::memcmp(h.magic, kShardMagic, 8) == 0,
                 "token shard '{}': bad magic (expected \"MOETOK01\"); not a token shard", name);
  MOETRAIN_CHECK(h.version == 1 || h.version == 2,
                 "token shard '{}': version {}, this build reads versions 1 and 2", name,
                 h.version);
  MOETRAIN_CHECK(h.vocab >= 1 && h.vocab <= kShardMaxVocab,
                 "token shard '{}': vocab size {} outside [1, {}]", name, h.vocab, kShardMaxVocab);
  MOETRAIN_CHECK(h.version == version_for(h.vocab),
                 "token shard '{}': version {} with vocab size {} (version 1 holds vocabularies up "
                 "to {}, version 2 larger ones)",
                 name, h.version, h.vocab, kShardMaxVocab16);
  const uint64_t w = shard_token_bytes(h.vocab);
  const uint64_t payload = bytes - kShardHeaderBytes;
  MOETRAIN_CHECK(payload % w == 0 && payload / w == h.count,
                 "token shard '{}': header says {} tokens ({} bytes of payload) but the file has "
                 "{} bytes after the header (truncated or padded)",
                 name, h.count,
                 h.count <= (UINT64_MAX - kShardHeaderBytes) / w ? h.count * w : UINT64_MAX,
                 payload);
  vocab_ = h.vocab;
  size_ = h.count;
  wide_ = w == 4;
  // The map is page-aligned and the header is 24 bytes, so the token view is aligned.
  tokens_ = file_.data() + kShardHeaderBytes;
  auto check = [&](const auto* t) {
    for (uint64_t i = 0; i < size_; ++i) {
      MOETRAIN_CHECK(t[i] < vocab_,
                     "token shard '{}': token {} at position {} is not below the vocab size {}",
                     name, t[i], i, vocab_);
    }
  };
  if (wide_)
    check(static_cast<const uint32_t*>(tokens_));
  else
    check(static_cast<const uint16_t*>(tokens_));
}

std::vector<int32_t> TokenShard::read_all() const {
  std::vector<int32_t> out(size_);
  read(0, static_cast<int64_t>(size_), out.data());
  return out;
}

TokenShards open_token_shards(const std::filesystem::path& dir, int64_t vocab, int64_t seq_len,
                              bool want_val) {
  auto open = [&](const char* file) {
    const std::filesystem::path p = dir / file;
    MOETRAIN_CHECK(std::filesystem::is_regular_file(p),
                   "data.dir = '{}' has no {}: prepare it first, e.g. `moetrain prepare --input "
                   "/usr/share/games/fortunes --out {}`",
                   dir.string(), file, dir.string());
    return std::make_unique<TokenShard>(p);
  };
  TokenShards s;
  s.train = open("train.bin");
  MOETRAIN_CHECK(s.train->vocab() <= static_cast<uint32_t>(vocab),
                 "{} has vocabulary {}, larger than model.vocab_size = {}",
                 s.train->path().string(), s.train->vocab(), vocab);
  MOETRAIN_CHECK(s.train->size() > static_cast<uint64_t>(seq_len) + 1,
                 "{} has {} tokens, too few for train.seq_len = {}", s.train->path().string(),
                 s.train->size(), seq_len);
  if (!want_val) return s;
  s.val = open("val.bin");
  // Found here rather than at the first evaluation, after the training it would waste.
  MOETRAIN_CHECK(s.val->size() > static_cast<uint64_t>(seq_len),
                 "{} has {} tokens, too few for train.seq_len = {} (validation needs at least {}; "
                 "prepare with a larger --val-fraction)",
                 s.val->path().string(), s.val->size(), seq_len, seq_len + 1);
  return s;
}

}  // namespace moetrain
