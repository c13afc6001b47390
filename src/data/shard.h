// Token shards: a 24-byte header then the tokens as little-endian uint16.
//
//   offset 0   magic "MOETOK01" (8 bytes)
//          8   version     uint32 (1)
//         12   vocab size  uint32 (1 .. 65536)
//         16   token count uint64
//         24   tokens      uint16 × count
//
// The reader maps the file and checks everything once at open (header, exact file size, every
// token < vocab), so the training loop can index tokens without checks.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>

#include "io/file.h"

namespace moetrain {

constexpr char kShardMagic[8] = {'M', 'O', 'E', 'T', 'O', 'K', '0', '1'};
constexpr uint32_t kShardVersion = 1;
constexpr std::size_t kShardHeaderBytes = 24;
constexpr uint32_t kShardMaxVocab = 65536;  // token ids must fit uint16

// Atomic (temporary file, fsync, rename). tokens: (n), each < vocab.
void write_token_shard(const std::filesystem::path& path, const uint16_t* tokens, uint64_t n,
                       uint32_t vocab);

class TokenShard {
 public:
  // Throws Error naming the file and the problem: bad magic, version, vocab, size or token.
  explicit TokenShard(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return file_.path(); }
  uint32_t vocab() const { return vocab_; }
  uint64_t size() const { return size_; }
  const uint16_t* tokens() const { return tokens_; }  // (size)
  std::span<const uint16_t> span() const { return {tokens_, static_cast<std::size_t>(size_)}; }

 private:
  MappedFile file_;
  uint32_t vocab_ = 0;
  uint64_t size_ = 0;
  const uint16_t* tokens_ = nullptr;
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
