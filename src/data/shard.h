// Token shards: a 24-byte header then the tokens as little-endian unsigned integers.
//
//   offset 0   magic "MOETOK01" (8 bytes)
//          8   version     uint32: 1 = uint16 tokens (vocab ≤ 65536), 2 = uint32 tokens
//         12   vocab size  uint32 (1 .. 65536 for version 1, 65537 .. 2^31 - 1 for version 2)
//         16   token count uint64
//         24   tokens      uint16 or uint32 × count
//
// The token width follows the vocabulary: a shard is written as version 1 whenever its ids fit
// uint16, so shards of the byte tokenizer and of vocabularies up to 65,536 (Mixtral's 32,000)
// take two bytes a token. The reader maps the file and checks everything once at open (header,
// exact file size, every token < vocab), so the training loop can read tokens without checks.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "io/file.h"

namespace moetrain {

constexpr char kShardMagic[8] = {'M', 'O', 'E', 'T', 'O', 'K', '0', '1'};
constexpr std::size_t kShardHeaderBytes = 24;
constexpr uint32_t kShardMaxVocab16 = 65536;           // version 1: ids fit uint16
constexpr uint32_t kShardMaxVocab = 2147483647;        // ids fit int32, the models' token type
// Bytes a token takes in a shard of vocabulary `vocab`.
constexpr std::size_t shard_token_bytes(uint64_t vocab) {
  return vocab <= kShardMaxVocab16 ? 2 : 4;
}

// Writes a shard of `count` tokens in pieces (a corpus larger than memory), atomically (temporary
// file, fsync, rename at commit). Every token is checked against the vocabulary as it comes.
class TokenShardWriter {
 public:
  TokenShardWriter(const std::filesystem::path& path, uint32_t vocab, uint64_t count);
  void append(std::span<const int32_t> tokens);
  // Throws unless exactly `count` tokens were appended.
  void commit();

 private:
  AtomicFileWriter out_;
  uint32_t vocab_;
  uint64_t count_, written_ = 0;
  std::vector<unsigned char> buf_;
};

// Atomic. tokens: (n), each < vocab.
void write_token_shard(const std::filesystem::path& path, const uint16_t* tokens, uint64_t n,
                       uint32_t vocab);
void write_token_shard(const std::filesystem::path& path, std::span<const int32_t> tokens,
                       uint32_t vocab);

class TokenShard {
 public:
  // Throws Error naming the file and the problem: bad magic, version, vocab, size or token.
  explicit TokenShard(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return file_.path(); }
  uint32_t vocab() const { return vocab_; }
  uint64_t size() const { return size_; }
  // Tokens [begin, begin + n) into out (n int32).
  void read(uint64_t begin, int64_t n, int32_t* out) const {
    if (wide_) {
      const uint32_t* t = static_cast<const uint32_t*>(tokens_) + begin;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(t[i]);
    } else {
      const uint16_t* t = static_cast<const uint16_t*>(tokens_) + begin;
      for (int64_t i = 0; i < n; ++i) out[i] = t[i];
    }
  }
  std::vector<int32_t> read_all() const;

 private:
  MappedFile file_;
  uint32_t vocab_ = 0;
  uint64_t size_ = 0;
  bool wide_ = false;
  const void* tokens_ = nullptr;
};

// A run's token shards: train.bin and val.bin in the data directory `moetrain prepare` wrote,
// checked for a model of vocab tokens and windows of seq_len + 1 tokens. want_val = false opens
// train.bin alone (a parameter-server worker). Errors name the file and what to do.
struct TokenShards {
  std::unique_ptr<TokenShard> train, val;
};
TokenShards open_token_shards(const std::filesystem::path& dir, int64_t vocab, int64_t seq_len,
                              bool want_val = true);

}  // namespace moetrain
