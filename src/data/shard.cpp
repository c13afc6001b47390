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

void write_token_shard(const std::filesystem::path& path, const uint16_t* tokens, uint64_t n,
                       uint32_t vocab) {
  MOETRAIN_CHECK(vocab >= 1 && vocab <= kShardMaxVocab,
                 "token shard '{}': vocab size {} outside [1, {}]", path.string(), vocab,
                 kShardMaxVocab);
  MOETRAIN_CHECK(tokens != nullptr || n == 0, "token shard '{}': null tokens for {} tokens",
                 path.string(), n);
  for (uint64_t i = 0; i < n; ++i) {
    MOETRAIN_CHECK(tokens[i] < vocab,
                   "token shard '{}': token {} at position {} is not below the vocab size {}",
                   path.string(), tokens[i], i, vocab);
  }
  ShardHeader h{};
  std::memcpy(h.magic, kShardMagic, 8);
  h.version = kShardVersion;
  h.vocab = vocab;
  h.count = n;
  AtomicFileWriter w(path);
  w.write(&h, sizeof(h));
  if (n > 0) w.write(tokens, n * sizeof(uint16_t));
  w.commit();
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
  MOETRAIN_CHECK(h.version == kShardVersion,
                 "token shard '{}': version {}, this build reads version {}", name, h.version,
                 kShardVersion);
  MOETRAIN_CHECK(h.vocab >= 1 && h.vocab <= kShardMaxVocab,
                 "token shard '{}': vocab size {} outside [1, {}]", name, h.vocab, kShardMaxVocab);
  const uint64_t payload = bytes - kShardHeaderBytes;
  MOETRAIN_CHECK(payload % 2 == 0 && payload / 2 == h.count,
                 "token shard '{}': header says {} tokens ({} bytes of payload) but the file has "
                 "{} bytes after the "
                 "header (truncated or padded)",
                 name, h.count,
                 h.count <= (UINT64_MAX - kShardHeaderBytes) / 2 ? h.count * 2 : UINT64_MAX,
                 payload);
  vocab_ = h.vocab;
  size_ = h.count;
  // The map is page-aligned and the header is 24 bytes, so the uint16 view is aligned.
  tokens_ = reinterpret_cast<const uint16_t*>(file_.data() + kShardHeaderBytes);
  for (uint64_t i = 0; i < size_; ++i) {
    MOETRAIN_CHECK(tokens_[i] < vocab_,
                   "token shard '{}': token {} at position {} is not below the vocab size {}", name,
                   tokens_[i], i, vocab_);
  }
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
