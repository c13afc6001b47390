// Corpora and tokenizers: JSONL, gzip, zstd and text files give the same shards; bad JSONL lines
// are named; a trained SentencePiece tokenizer round-trips the text; wide vocabularies take uint32
// shards; a corpus far larger than prepare's memory streams through.
#include <gtest/gtest.h>
#include <zlib.h>
#include <zstd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/corpus.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "data/tokenizer_train.h"
#include "support/expect_error.h"
#include "support/temp_dir.h"

namespace moetrain {
namespace {

namespace fs = std::filesystem;
using namespace testing;

const std::vector<std::string> kDocs = {
    "The first document.\nIt has two lines.\n",
    "Zweites Dokument: äöü \"quoted\" and a tab\there.",
    "third\n\nwith a blank line\n",
};

std::string json_line(const std::string& text) {
  return nlohmann::json{{"id", 1}, {"text", text}}.dump() + "\n";
}

void write_gzip(const fs::path& p, const std::string& bytes) {
  gzFile f = gzopen(p.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  gzclose(f);
}

void write_zstd(const fs::path& p, const std::string& bytes) {
  std::string out(ZSTD_compressBound(bytes.size()), '\0');
  const std::size_t n = ZSTD_compress(out.data(), out.size(), bytes.data(), bytes.size(), 3);
  ASSERT_FALSE(ZSTD_isError(n));
  out.resize(n);
  std::ofstream(p, std::ios::binary) << out;
}

PrepareReport prepare(const std::vector<fs::path>& inputs, const fs::path& out,
                      const Tokenizer& tok = Tokenizer(), BadLines bad = BadLines::Refuse) {
  PrepareOptions o;
  o.inputs = inputs;
  o.out_dir = out;
  o.val_fraction = 0.2;
  o.tokenizer = tok;
  o.bad_lines = bad;
  return prepare_corpus(o);
}

TEST(Corpus, JsonlGzipZstdAndTextFilesGiveIdenticalShards) {
  TempDir dir("corpus");
  std::string jsonl;
  for (std::size_t i = 0; i < kDocs.size(); ++i) {
    dir.write("texts/" + std::to_string(i) + ".txt", kDocs[i]);
    jsonl += json_line(kDocs[i]);
  }
  dir.write("plain/c.jsonl", jsonl + "\n   \n");  // blank lines are no documents
  fs::create_directories(dir / "gz");
  write_gzip(dir / "gz" / "c.jsonl.gz", jsonl);
  fs::create_directories(dir / "zst");
  write_zstd(dir / "zst" / "c.jsonl.zst", jsonl);
  // A compressed text file is known by its bytes, whatever its name.
  fs::create_directories(dir / "gztexts");
  for (std::size_t i = 0; i < kDocs.size(); ++i)
    write_gzip(dir / "gztexts" / (std::to_string(i) + ".txt"), kDocs[i]);

  const PrepareReport ref = prepare({dir / "texts"}, dir / "out_texts");
  EXPECT_EQ(ref.documents, kDocs.size());
  std::string all;
  for (const auto& d : kDocs) all += d + "\n";  // each document, then bytes' end of document
  EXPECT_EQ(ref.train_tokens + ref.val_tokens, all.size());
  for (const char* name : {"plain", "gz", "zst", "gztexts"}) {
    SCOPED_TRACE(name);
    const PrepareReport r = prepare({dir / name}, dir / (std::string("out_") + name));
    EXPECT_EQ(r.documents, kDocs.size());
    for (const char* shard : {"train.bin", "val.bin"})
      EXPECT_EQ(read_file_bytes(dir / (std::string("out_") + name) / shard),
                read_file_bytes(dir / "out_texts" / shard));
  }
}

TEST(Corpus, MalformedJsonlLinesAreNamedThenRefusedOrSkipped) {
  TempDir dir("corpus_bad");
  const fs::path f = dir.write("c.jsonl", json_line("good one") + "{\"text\": \"cut off\n" +
                                              json_line("good two") + "[1, 2]\n" +
                                              "{\"body\": \"x\"}\n{\"text\": 7}\n");
  expect_error([&] { prepare({f}, dir / "out"); },
               {f.string() + ":2: not valid JSON", "--bad-lines skip"});
  EXPECT_FALSE(fs::exists(dir / "out" / "train.bin"));
  const PrepareReport r = prepare({f}, dir / "out", Tokenizer(), BadLines::Skip);
  EXPECT_EQ(r.documents, 2u);
  EXPECT_EQ(r.bad_lines, 4u);
  EXPECT_EQ(r.train_tokens + r.val_tokens, std::string("good one\ngood two\n").size());
  const auto meta = nlohmann::json::parse(read_file_bytes(dir / "out" / "meta.json"));
  EXPECT_EQ(meta["bad_lines_skipped"], 4);
  EXPECT_EQ(meta["sources"][0]["bad_lines"], 4);

  CorpusOptions o;
  o.inputs = {f};
  o.bad_lines = BadLines::Skip;
  o.jsonl_field = "body";
  const CorpusScan scan = scan_corpus(o);
  CorpusReader reader(scan, o);
  TextPiece p;
  ASSERT_TRUE(reader.next(p));
  EXPECT_EQ(p.text, "x");
  EXPECT_FALSE(reader.next(p));

  // Bad input, named: an empty corpus, a tokenizer that is not one.
  dir.write("empty/a.txt", "");
  dir.write("empty/b.jsonl", "\n\n");
  expect_error([&] { prepare({dir / "empty"}, dir / "out2"); },
               {"hold no text", (dir / "empty").string()});
  const fs::path junk = dir.write("junk.model", "not a model");
  expect_error([&] { load_tokenizer(junk.string()); }, {junk.string(), "not a SentencePiece"});
  expect_error([&] { load_tokenizer((dir / "empty").string()); }, "without tokenizer.model");
}

TEST(Corpus, WideVocabulariesTakeUint32Shards) {
  TempDir dir("wide");
  const std::vector<int32_t> ids = {0, 99999, 65536, 7};
  write_token_shard(dir / "w.bin", ids, 100000);
  EXPECT_EQ(fs::file_size(dir / "w.bin"), kShardHeaderBytes + 4 * ids.size());
  TokenShard s(dir / "w.bin");
  EXPECT_EQ(s.vocab(), 100000u);
  EXPECT_EQ(s.read_all(), ids);
  std::vector<int32_t> window(2);
  s.read(1, 2, window.data());
  EXPECT_EQ(window, (std::vector<int32_t>{99999, 65536}));
  expect_error([&] { write_token_shard(dir / "x.bin", std::vector<int32_t>{100000}, 100000); },
               "token 100000 at position 0 is not below the vocab size 100000");
}

// A tokenizer trained on the fortunes text: shards decode back to the documents, each ended by
// </s>; the data directory records and carries the tokenizer.
TEST(Corpus, TrainedSentencePieceTokenizerPreparesAndRoundTrips) {
  TempDir dir("spm");
  TokenizerTrainOptions t;
  t.corpus.inputs = {"/usr/share/games/fortunes/fortunes"};
  t.out_dir = dir / "tok";
  t.vocab_size = 2048;
  const Tokenizer tok = train_tokenizer(t);
  EXPECT_EQ(tok.vocab_size(), 2048);
  EXPECT_EQ(tok.eod_id(), 2);
  for (const char* f : {"tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"})
    EXPECT_TRUE(fs::exists(t.out_dir / f)) << f;
  const std::string text = "A fortune: digits 2024 split, bytes ✓ kept\n\tand whitespace  too.";
  const std::vector<int32_t> ids = tok.encode(text);
  EXPECT_LT(ids.size(), text.size());
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(load_tokenizer(t.out_dir.string()).fingerprint(), tok.fingerprint());

  for (std::size_t i = 0; i < kDocs.size(); ++i)
    dir.write("texts/" + std::to_string(i) + ".txt", kDocs[i]);
  PrepareOptions o;
  o.inputs = {dir / "texts"};
  o.out_dir = dir / "data";
  o.val_fraction = 0;
  o.tokenizer = tok;
  prepare_corpus(o);
  TokenShard s(dir / "data" / "train.bin");
  EXPECT_EQ(s.vocab(), 2048u);
  std::vector<int32_t> want;
  for (const auto& d : kDocs) {
    tok.encode_into(d, want);
    want.push_back(tok.eod_id());
  }
  EXPECT_EQ(s.read_all(), want);
  EXPECT_EQ(data_tokenizer(dir / "data").fingerprint(), tok.fingerprint());
  EXPECT_EQ(data_vocab_size(dir / "data"), 2048);
  const auto meta = nlohmann::json::parse(read_file_bytes(dir / "data" / "meta.json"));
  EXPECT_EQ(meta["tokenizer"]["kind"], "sentencepiece");
  EXPECT_EQ(meta["tokenizer"]["fingerprint"], tok.fingerprint());

  // The data directory's model replaced by another: refused, naming both.
  TokenizerTrainOptions t2 = t;
  t2.out_dir = dir / "tok2";
  t2.vocab_size = 1024;
  train_tokenizer(t2);
  fs::copy_file(t2.out_dir / "tokenizer.model", dir / "data" / "tokenizer.model",
                fs::copy_options::overwrite_existing);
  expect_error([&] { data_tokenizer(dir / "data"); },
               {"not the tokenizer the shards were made with", tok.fingerprint()});
  expect_error([&] { train_tokenizer([&] { auto b = t; b.vocab_size = 100; return b; }()); },
               "--vocab-size 100");
}

// A /proc/self/status figure ("VmRSS", "VmHWM") in bytes.
long status_bytes(const std::string& key) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind(key + ":", 0) == 0) return std::stol(line.substr(key.size() + 1)) * 1024L;
  ADD_FAILURE() << "no " << key << " in /proc/self/status";
  return 0;
}

// A 96 MiB corpus (three files, 12 times prepare's 8 MiB batch) prepares in memory of the order
// of a batch, not of the corpus: the peak resident memory during prepare_corpus (VmHWM, reset
// first) exceeds the resident memory before it by less than 80 MiB, where holding the text alone
// would take 96 MiB (and its tokens another 384 MiB as int32).
TEST(Corpus, ACorpusLargerThanPreparesMemoryStreamsThrough) {
  TempDir dir("stream");
  const std::string line = "Streaming text, line after line, never all of it at once.\n";
  std::string block;
  while (block.size() < (std::size_t{1} << 20)) block += line;
  fs::create_directories(dir / "big");
  uint64_t bytes = 0;
  for (int f = 0; f < 3; ++f) {
    std::ofstream out(dir / "big" / (std::to_string(f) + ".txt"), std::ios::binary);
    for (int i = 0; i < 32; ++i) out << block, bytes += block.size();
  }
  block = std::string();
  {
    std::ofstream reset("/proc/self/clear_refs");
    reset << "5";  // resets VmHWM to the current resident size (Linux 4.0+)
    ASSERT_TRUE(reset.good()) << "cannot reset the peak resident size";
  }
  const long before = status_bytes("VmRSS");
  PrepareOptions o;
  o.inputs = {dir / "big"};
  o.out_dir = dir / "out";
  const PrepareReport r = prepare_corpus(o);
  const long peak = status_bytes("VmHWM");
  EXPECT_EQ(r.train_tokens + r.val_tokens, bytes + 3);
  std::printf("prepare of %llu MiB: resident %ld MiB before, peak %ld MiB\n",
              static_cast<unsigned long long>(bytes >> 20), before >> 20, peak >> 20);
  EXPECT_LT(peak - before, 80L << 20);
}

}  // namespace
}  // namespace moetrain
