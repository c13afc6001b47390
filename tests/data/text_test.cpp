// Byte tokenizer, token shards and `prepare` (the batch loaders: loader_test.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/check.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "support/corpus.h"
#include "support/expect_error.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::testing;
using moetrain::testing::read_file_bytes;
using moetrain::testing::TempDir;

namespace {

std::string shard_bytes(const char* magic, uint32_t version, uint32_t vocab, uint64_t count,
                        const std::vector<uint16_t>& tokens) {
  std::string s(magic, 8);
  s.append(reinterpret_cast<const char*>(&version), 4);
  s.append(reinterpret_cast<const char*>(&vocab), 4);
  s.append(reinterpret_cast<const char*>(&count), 8);
  s.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Tokenizer

TEST(ByteTokenizer, RoundTripsEveryByte) {
  std::string all;
  for (int c = 0; c < 256; ++c) all.push_back(static_cast<char>(c));
  all += "h\xC3\xA9llo, w\xC3\xB6rld\n";
  auto tokens = byte_encode(all);
  ASSERT_EQ(tokens.size(), all.size());
  for (std::size_t i = 0; i < all.size(); ++i) EXPECT_EQ(tokens[i], static_cast<uint8_t>(all[i]));
  EXPECT_EQ(byte_decode(std::span<const uint16_t>(tokens)), all);
  std::vector<int32_t> ids(tokens.begin(), tokens.end());
  EXPECT_EQ(byte_decode(std::span<const int32_t>(ids)), all);
  EXPECT_TRUE(byte_encode("").empty());
  EXPECT_EQ(byte_decode(std::span<const uint16_t>()), "");

  std::vector<int32_t> bad = {65, -1};
  expect_error([&] { byte_decode(std::span<const int32_t>(bad)); }, "token -1 at position 1");
  std::vector<uint16_t> big = {256};
  expect_error([&] { byte_decode(std::span<const uint16_t>(big)); }, "token 256 at position 0");
}

// ---------------------------------------------------------------------------------------------
// Shards

TEST(TokenShard, RoundTripAndExactLayout) {
  TempDir dir("shard");
  for (uint64_t n : {0u, 1u, 1001u}) {
    auto tokens = scrambled_tokens(n);
    auto path = dir / ("s" + std::to_string(n) + ".bin");
    write_token_shard(path, tokens.data(), n, 256);
    EXPECT_FALSE(std::filesystem::exists(path.string() + ".tmp"));
    EXPECT_EQ(read_file_bytes(path), shard_bytes("MOETOK01", 1, 256, n, tokens));
    TokenShard s(path);
    EXPECT_EQ(s.size(), n);
    EXPECT_EQ(s.vocab(), 256u);
    EXPECT_EQ(s.read_all(), std::vector<int32_t>(tokens.begin(), tokens.end()));
  }
  // The largest vocabulary: every uint16 value is a valid token.
  std::vector<uint16_t> wide = {0, 65535, 300, 1};
  write_token_shard(dir / "wide.bin", wide.data(), wide.size(), 65536);
  TokenShard w(dir / "wide.bin");
  EXPECT_EQ(w.vocab(), 65536u);
  EXPECT_EQ(w.read_all()[1], 65535);

  expect_error([&] { write_token_shard(dir / "x.bin", wide.data(), wide.size(), 256); },
               "token 65535 at position 1 is not below the vocab size 256");
  expect_error([&] { write_token_shard(dir / "x.bin", wide.data(), 0, 0); }, "vocab size 0");
  EXPECT_FALSE(std::filesystem::exists(dir / "x.bin"));
}

TEST(TokenShard, CorruptShardsRejected) {
  TempDir dir("shard");
  const std::vector<uint16_t> toks = {1, 2, 3, 4};
  int k = 0;
  auto rejected = [&](const std::string& bytes, std::string_view needle) {
    auto path = dir.write("bad" + std::to_string(k++) + ".bin", bytes);
    expect_error([&] { TokenShard s(path); }, {std::string(needle), path.filename().string()});
  };
  const std::string good = shard_bytes("MOETOK01", 1, 256, 4, toks);
  ASSERT_NO_THROW(TokenShard(dir.write("good.bin", good)));
  rejected(shard_bytes("MOETOK02", 1, 256, 4, toks), "bad magic");
  rejected(shard_bytes("GPT2TOKS", 1, 256, 4, toks), "bad magic");
  rejected(shard_bytes("MOETOK01", 2, 256, 4, toks), "version 2");
  rejected(shard_bytes("MOETOK01", 1, 0, 4, toks), "vocab size 0");
  rejected(shard_bytes("MOETOK01", 1, 70000, 4, toks), "vocab size 70000");
  rejected(good.substr(0, good.size() - 1), "header says 4 tokens");  // odd payload
  rejected(good.substr(0, good.size() - 2), "header says 4 tokens");  // one token short
  rejected(good + std::string(2, '\0'), "header says 4 tokens");      // one token extra
  rejected(shard_bytes("MOETOK01", 1, 256, ~uint64_t{0}, toks), "truncated or padded");
  rejected(good.substr(0, 20), "shorter than the 24-byte header");
  rejected("", "shorter than the 24-byte header");
  rejected(shard_bytes("MOETOK01", 1, 4, 4, toks),
           "token 4 at position 3 is not below the vocab size 4");
  rejected(shard_bytes("MOETOK01", 1, 256, 2, {7, 256}), "token 256 at position 1");
  expect_error([&] { TokenShard s(dir / "missing.bin"); }, "missing.bin");
}

// ---------------------------------------------------------------------------------------------
// prepare

// Tokens are bytes: a Latin-1 text (not UTF-8) is taken as it is; binary files, indexes, symlinks
// and empty files are skipped, each with its reason.
TEST(Prepare, TakesTextInAnyEncodingSkipsBinaryIndexAndSymlinks) {
  TempDir dir("prep");
  auto in = dir / "in";
  dir.write("in/a.txt", "hello");
  dir.write("in/sub/b.txt", "world\n");
  dir.write("in/bin.txt", std::string("ab\0cd", 5));
  dir.write("in/a.dat", "plain-looking but an index");
  dir.write("in/latin1.txt", "caf\xE9");
  dir.write("in/empty.txt", "");
  std::filesystem::create_symlink("a.txt", in / "a.txt.u8");
  auto extra = dir.write("extra.txt", "!");

  PrepareOptions opt;
  opt.inputs = {in, extra};
  opt.out_dir = dir / "out";
  opt.val_fraction = 0.0;
  PrepareReport r = prepare_corpus(opt);

  ASSERT_EQ(r.sources.size(), 4u);
  EXPECT_EQ(r.sources[0].path, (in / "a.txt").string());
  EXPECT_EQ(r.sources[1].path, (in / "latin1.txt").string());
  EXPECT_EQ(r.sources[2].path, (in / "sub/b.txt").string());
  EXPECT_EQ(r.sources[3].path, extra.string());
  EXPECT_EQ(r.bytes_taken, 5u + 4u + 6u + 1u);
  std::set<std::string> skipped;
  for (const auto& s : r.skipped)
    skipped.insert(std::filesystem::path(s.path).filename().string() + ":" + s.reason);
  EXPECT_EQ(skipped,
            (std::set<std::string>{"a.dat:index file (.dat)", "a.txt.u8:symlink",
                                   "bin.txt:binary: NUL byte at offset 2", "empty.txt:empty"}));
  EXPECT_EQ(r.bytes_skipped, 5u + 26u);

  const std::string expected = "hello\ncaf\xE9\nworld\n\n!\n";  // each document, then '\n'
  EXPECT_EQ(r.train_tokens, expected.size());
  EXPECT_EQ(r.val_tokens, 0u);
  TokenShard train(opt.out_dir / "train.bin"), val(opt.out_dir / "val.bin");
  EXPECT_EQ(train.vocab(), 256u);
  EXPECT_EQ(byte_decode(train.read_all()), expected);
  EXPECT_EQ(val.size(), 0u);

  auto meta = nlohmann::json::parse(read_file_bytes(opt.out_dir / "meta.json"));
  EXPECT_EQ(meta["vocab_size"], 256);
  EXPECT_EQ(meta["train_tokens"], expected.size());
  EXPECT_EQ(meta["val_tokens"], 0);
  EXPECT_EQ(meta["val_fraction"], 0.0);
  EXPECT_EQ(meta["sources"].size(), 4u);
  EXPECT_EQ(meta["sources"][2]["path"], (in / "sub/b.txt").string());
  EXPECT_EQ(meta["skipped"].size(), 4u);
}

// Prepared into its own input directory, a second run skips the first's outputs (its meta.json
// is text and would otherwise join the corpus).
TEST(Prepare, IntoItsOwnInputDirectorySkipsItsOwnOutputs) {
  TempDir dir("prep_self");
  dir.write("in/a.txt", "hello");
  PrepareOptions opt;
  opt.inputs = {dir / "in"};
  opt.out_dir = dir / "in";
  opt.val_fraction = 0.0;
  prepare_corpus(opt);
  PrepareReport again = prepare_corpus(opt);
  ASSERT_EQ(again.sources.size(), 1u);
  EXPECT_EQ(again.sources[0].path, (dir / "in" / "a.txt").string());
  EXPECT_EQ(again.train_tokens, 6u);  // "hello" and its end of document
  std::set<std::string> skipped;
  for (const auto& s : again.skipped)
    skipped.insert(std::filesystem::path(s.path).filename().string() + ":" + s.reason);
  EXPECT_EQ(skipped, (std::set<std::string>{"meta.json:an output of this command",
                                            "train.bin:an output of this command",
                                            "val.bin:an output of this command"}));
}

TEST(Prepare, ValIsSpreadOverTheCorpusInChunks) {
  // Five files of one letter each: where val's letters come from shows where val was taken.
  TempDir dir("prep");
  std::string corpus;
  for (char c = 'a'; c <= 'e'; ++c) {
    std::string text(1000, c);
    dir.write(std::string("in/") + c + ".txt", text);
    corpus += text + "\n";
  }
  PrepareOptions opt;
  opt.inputs = {dir / "in"};
  opt.out_dir = dir / "out";
  opt.val_fraction = 0.1;
  PrepareReport r = prepare_corpus(opt);
  const uint64_t total = corpus.size();
  EXPECT_EQ(r.chunk_tokens, split_chunk_tokens(total, 0.1));
  EXPECT_EQ(r.chunk_tokens, 31u);  // floor(5005 · 0.1 / 16)
  EXPECT_EQ(r.train_tokens + r.val_tokens, total);

  // Reference split, from the documented rule.
  std::string want_train, want_val;
  for (uint64_t i = 0; i * 31 < total; ++i) {
    const bool val = std::floor((i + 1) * 0.1) > std::floor(i * 0.1);
    (val ? want_val : want_train) += corpus.substr(i * 31, 31);
  }
  std::string train = byte_decode(TokenShard(opt.out_dir / "train.bin").read_all());
  std::string val = byte_decode(TokenShard(opt.out_dir / "val.bin").read_all());
  EXPECT_EQ(train, want_train);
  EXPECT_EQ(val, want_val);
  EXPECT_NEAR(static_cast<double>(val.size()) / static_cast<double>(total), 0.1,
              31.0 / static_cast<double>(total));
  for (char c = 'a'; c <= 'e'; ++c)
    EXPECT_NE(val.find(c), std::string::npos) << "no val text from file " << c;

  // Same inputs, same shards.
  opt.out_dir = dir / "out2";
  prepare_corpus(opt);
  EXPECT_EQ(read_file_bytes(dir / "out" / "train.bin"),
            read_file_bytes(dir / "out2" / "train.bin"));
  EXPECT_EQ(read_file_bytes(dir / "out" / "val.bin"), read_file_bytes(dir / "out2" / "val.bin"));
}

TEST(Prepare, SplitRule) {
  std::vector<uint64_t> val;
  for (uint64_t i = 0; i < 12; ++i) {
    if (is_val_chunk(i, 0.25)) val.push_back(i);
  }
  EXPECT_EQ(val, (std::vector<uint64_t>{3, 7, 11}));
  int n05 = 0;
  for (uint64_t i = 0; i < 1000; ++i) n05 += is_val_chunk(i, 0.05);
  EXPECT_EQ(n05, 50);
  for (uint64_t i = 0; i < 100; ++i) EXPECT_FALSE(is_val_chunk(i, 0.0));
  EXPECT_FALSE(is_val_chunk(0, 0.99));  // chunk 0 always trains
  EXPECT_EQ(split_chunk_tokens(4'000'000, 0.05), 8192u);
  EXPECT_EQ(split_chunk_tokens(1600, 0.1), 10u);
  EXPECT_EQ(split_chunk_tokens(3, 0.1), 1u);
}

TEST(Prepare, Errors) {
  TempDir dir("prep");
  auto good = dir.write("in/a.txt", "some text");
  PrepareOptions opt;
  opt.out_dir = dir / "out";

  opt.inputs = {dir / "in" / "missing.txt"};
  expect_error([&] { prepare_corpus(opt); }, "missing.txt' does not exist");

  dir.write("bin/x.dat", "index");
  dir.write("bin/y", std::string("\0\1\2", 3));
  opt.inputs = {dir / "bin"};
  expect_error([&] { prepare_corpus(opt); }, "hold no text");

  opt.inputs = {good};
  for (double f : {-0.1, 1.0, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    opt.val_fraction = f;
    expect_error([&] { prepare_corpus(opt); }, "val fraction");
  }
  opt.val_fraction = 0.05;
  opt.out_dir = good / "sub";  // below a regular file: cannot be created
  expect_error([&] { prepare_corpus(opt); }, "cannot create output directory");
  opt.out_dir = good;
  expect_error([&] { prepare_corpus(opt); }, "output");
  opt.inputs = {};
  opt.out_dir = dir / "out";
  expect_error([&] { prepare_corpus(opt); }, "no input");
}

TEST(Prepare, DebianFortunes) {
  const std::filesystem::path fortunes = "/usr/share/games/fortunes";
  ASSERT_TRUE(std::filesystem::is_directory(fortunes))
      << "Debian package 'fortunes' is a project dependency";
  TempDir dir("prep");
  PrepareOptions opt;
  opt.inputs = {fortunes};
  opt.out_dir = dir / "out";
  PrepareReport r = prepare_corpus(opt);
  ASSERT_GT(r.sources.size(), 10u);
  int dat = 0, links = 0;
  for (const auto& s : r.sources) {
    EXPECT_NE(std::filesystem::path(s.path).extension(), ".dat") << s.path;
    EXPECT_NE(std::filesystem::path(s.path).extension(), ".u8") << s.path;
  }
  for (const auto& s : r.skipped) {
    dat += s.reason == "index file (.dat)";
    links += s.reason == "symlink";
  }
  EXPECT_EQ(dat, static_cast<int>(r.sources.size()));  // one index per text file
  EXPECT_GT(links, 0);
  EXPECT_EQ(r.train_tokens + r.val_tokens, r.bytes_taken + r.sources.size());  // + one '\n' each
  EXPECT_NEAR(static_cast<double>(r.val_tokens) / static_cast<double>(r.bytes_taken), 0.05, 0.005);
}
