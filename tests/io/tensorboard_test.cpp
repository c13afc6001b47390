// TensorBoard event files: TFRecord framing and the hand-encoded Event messages against bytes that
// TensorBoard's own Python (its RecordWriter, masked_crc32c and generated protobuf classes)
// produced, records read back with their checksums verified, a torn file's complete records still
// readable, and the metrics writer's second sink (which lines become which tags).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "io/metrics.h"
#include "io/tensorboard.h"
#include "support/expect_error.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

std::string from_hex(std::string_view hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return out;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

std::vector<fs::path> event_files(const fs::path& dir) {
  std::vector<fs::path> out;
  if (fs::exists(dir))
    for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

// The tags of a Summary in order, read back from its encoding (field 1 of each Value, itself
// field 1 of the Summary).
std::vector<std::string> tags_of(const Summary& s) {
  std::vector<std::string> tags;
  const std::string& b = s.bytes();
  std::size_t at = 0;
  auto varint = [&](std::size_t& i) {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      const auto c = static_cast<uint8_t>(b[i++]);
      v |= uint64_t{c & 0x7fu} << shift;
      if (!(c & 0x80)) return v;
    }
  };
  while (at < b.size()) {
    EXPECT_EQ(static_cast<uint8_t>(b[at]), 0x0a);  // Summary.value, length-delimited
    ++at;
    const uint64_t len = varint(at);
    std::size_t i = at;
    EXPECT_EQ(static_cast<uint8_t>(b[i]), 0x0a);  // Value.tag
    ++i;
    const uint64_t tag_len = varint(i);
    tags.push_back(b.substr(i, tag_len));
    at += len;
  }
  return tags;
}

}  // namespace

TEST(TensorboardTest, MaskedCrcMatchesTensorboard) {
  EXPECT_EQ(masked_crc32c("", 0), 0xa282ead8u);
  EXPECT_EQ(masked_crc32c("123456789", 9), 0xc78ab0e5u);
  EXPECT_EQ(masked_crc32c("brain.Event:2", 13), 0x7c0601eeu);
  const std::string zeros(32, '\0');
  EXPECT_EQ(masked_crc32c(zeros.data(), 8), 0x07980329u);
  EXPECT_EQ(masked_crc32c(zeros.data(), 32), 0x0fd7fffau);
}

TEST(TensorboardTest, RecordFramingMatchesTensorboard) {
  EXPECT_EQ(tfrecord_frame("123456789"),
            from_hex("090000000000000037f97139313233343536373839e5b08ac7"));
}

TEST(TensorboardTest, EventsMatchTensorboardsProtobuf) {
  EXPECT_EQ(encode_file_version_event(1.5),
            from_hex("09000000000000f83f1a0d627261696e2e4576656e743a32"));
  Summary s;
  s.add_scalar("loss", 0.25f);
  Histogram h;
  h.min = 1, h.max = 2, h.num = 3, h.sum = 5, h.sum_squares = 9;
  h.bucket_limit = {1.5, 2.5};
  h.bucket = {1, 2};
  s.add_histogram("h", h);
  EXPECT_EQ(encode_summary_event(2.0, 300, s),
            from_hex("09000000000000004010ac022a650a0b0a046c6f7373150000803e0a560a01682a51090000"
                     "00000000f03f11000000000000004019000000000000084021000000000000144029000000"
                     "00000022403210000000000000f83f00000000000004403a10000000000000f03f00000000"
                     "00000040"));
  // A zero scalar is still present (a oneof member), and a negative step is 10 varint bytes.
  Summary zero;
  zero.add_scalar("x", 0.0f);
  EXPECT_EQ(encode_summary_event(2.0, -1, zero),
            from_hex("09000000000000004010ffffffffffffffffff012a0a0a080a01781500000000"));
  EXPECT_EQ(encode_restart_event(2.0, 4), from_hex("09000000000000004010043a020801"));
  Histogram bad;
  bad.bucket = {1};
  expect_error([&] { Summary().add_histogram("bad", bad); }, "histogram 'bad'");
}

TEST(TensorboardTest, RecordsReadBackAndTornTailIsDropped) {
  TempDir dir("tb");
  std::string events[3];
  fs::path path;
  {
    EventFileWriter w(dir.path() / "tb");
    path = w.path();
    EXPECT_TRUE(path.filename().string().starts_with("events.out.tfevents."));
    for (int i = 0; i < 3; ++i) {
      Summary s;
      s.add_scalar("loss", 1.0f / static_cast<float>(i + 1));
      w.write(i + 1, s);
      events[i] = s.bytes();
    }
    w.write(4, Summary());  // nothing to write: no record
  }
  std::vector<std::string> records = read_tfrecords(path);
  ASSERT_EQ(records.size(), 4u);
  EXPECT_NE(records[0].find("brain.Event:2"), std::string::npos);
  for (int i = 0; i < 3; ++i)
    EXPECT_NE(records[static_cast<std::size_t>(i + 1)].find(events[i]), std::string::npos);

  // A crash inside the last record, at every cut: the complete records before it remain.
  const std::string bytes = read_all(path);
  const std::size_t last = bytes.size() - tfrecord_frame(records[3]).size();
  for (std::size_t cut = last; cut < bytes.size(); ++cut) {
    const fs::path torn = dir.write("torn", bytes.substr(0, cut));
    EXPECT_EQ(read_tfrecords(torn).size(), 3u) << "cut at " << cut;
  }
  // A flipped byte in a body is refused, naming the file.
  std::string flipped = bytes;
  flipped[last - 6] ^= 0x01;
  const fs::path bad = dir.write("flipped", flipped);
  expect_error([&] { read_tfrecords(bad); }, {bad.string(), "corrupt body"});
}

TEST(TensorboardTest, NewFileEachOpening) {
  TempDir dir("tb");
  EventFileWriter a(dir.path());
  EventFileWriter b(dir.path());  // within the same second: a suffixed name, not the same file
  EXPECT_NE(a.path(), b.path());
  EXPECT_EQ(event_files(dir.path()).size(), 2u);
}

TEST(TensorboardTest, MetricsLineToValues) {
  const nlohmann::json line = {{"step", 7},
                               {"loss", 2.5},
                               {"skipped", true},
                               {"dropped_fraction", {0.0, 0.125}},
                               {"tokens_per_expert", {{3, 0, 1}, {2, 2, 0}}},
                               {"note", "text"},
                               {"note_count", 2}};
  Summary s;
  int64_t step = 0;
  ASSERT_TRUE(metrics_summary(line, step, s));
  EXPECT_EQ(step, 7);
  // nlohmann::json keeps keys sorted; tags are grouped as tensorboard_tag says.
  EXPECT_EQ(tags_of(s), (std::vector<std::string>{
                            "moe/layer_0/dropped_fraction", "moe/layer_1/dropped_fraction",
                            "train/loss", "note_count", "train/skipped",
                            "moe/layer_0/tokens_per_expert", "moe/layer_0/expert_utilisation",
                            "moe/layer_0/max_mean_load", "moe/layer_1/tokens_per_expert",
                            "moe/layer_1/expert_utilisation", "moe/layer_1/max_mean_load"}));
  Summary none;
  EXPECT_FALSE(metrics_summary({{"rollback_to", 3}}, step, none));
  EXPECT_TRUE(none.empty());
}

TEST(TensorboardTest, PerRankListIsOneHistogram) {
  const nlohmann::json line = {
      {"step", 3}, {"rank_step_time_s", {0.5, 1.5}}, {"rank_compute_s", {0.25, 1.25}}};
  Summary s, want;
  int64_t step = 0;
  ASSERT_TRUE(metrics_summary(line, step, s));
  EXPECT_EQ(tags_of(s), (std::vector<std::string>{"perf/rank_compute_s", "perf/rank_step_time_s"}));
  Histogram h;
  h.min = 0, h.max = 1, h.num = 2, h.sum = 1.5, h.sum_squares = 1.5;
  h.bucket_limit = {1, 2}, h.bucket = {0.5, 1.5};
  want.add_histogram("perf/rank_compute_s", {0, 1, 1.5, 1.25, 1.25, {1, 2}, {0.25, 1.25}},
                     tensorboard_tag("rank_compute_s").description);
  want.add_histogram("perf/rank_step_time_s", h, tensorboard_tag("rank_step_time_s").description);
  EXPECT_EQ(s.bytes(), want.bytes());
}

TEST(TensorboardTest, TagsAreGroupedAndDescribed) {
  EXPECT_EQ(tensorboard_tag("loss").tag, "train/loss");
  EXPECT_EQ(tensorboard_tag("lr").tag, "train/lr");
  EXPECT_EQ(tensorboard_tag("grad_norm").tag, "train/grad_norm");
  EXPECT_EQ(tensorboard_tag("val_loss").tag, "eval/loss");
  EXPECT_EQ(tensorboard_tag("tokens_per_s").tag, "perf/tokens_per_s");
  EXPECT_EQ(tensorboard_tag("comm_exposed_s").tag, "comm/exposed_s");
  EXPECT_EQ(tensorboard_tag("imbalance").tag, "moe/imbalance");
  EXPECT_EQ(tensorboard_tag("load_entropy", 3).tag, "moe/layer_3/load_entropy");
  EXPECT_EQ(tensorboard_tag("profile_dense_gemm_s").tag, "perf/profile_dense_gemm_s");
  for (const char* key : {"loss", "lr", "grad_norm", "val_loss", "tokens_per_s", "comm_total_s",
                          "imbalance", "tokens_per_expert", "expert_utilisation"})
    EXPECT_FALSE(tensorboard_tag(key, 0).description.empty()) << key;
  // A key the table does not know keeps its name and has no description.
  EXPECT_EQ(tensorboard_tag("new_key").tag, "new_key");
  EXPECT_EQ(tensorboard_tag("new_list", 1).tag, "new_list/layer_1");
  EXPECT_TRUE(tensorboard_tag("new_key").description.empty());
}

TEST(TensorboardTest, DescriptionIsSummaryMetadataOncePerTag) {
  // Value { tag: "x", simple_value: 1, metadata { summary_description: "d" } }, as TensorBoard's
  // protobuf classes serialize it.
  Summary s;
  s.add_scalar("x", 1.0f, "d");
  EXPECT_EQ(s.bytes(), from_hex("0a0d0a0178150000803f4a031a0164"));
  std::set<std::string> described;
  Summary first, second;
  int64_t step = 0;
  ASSERT_TRUE(metrics_summary({{"step", 1}, {"loss", 2.0}}, step, first, &described));
  ASSERT_TRUE(metrics_summary({{"step", 2}, {"loss", 1.0}}, step, second, &described));
  const std::string d(tensorboard_tag("loss").description);
  EXPECT_NE(first.bytes().find(d), std::string::npos);
  EXPECT_EQ(second.bytes().find(d), std::string::npos);  // described in the file already
  EXPECT_EQ(described, (std::set<std::string>{"train/loss"}));
}

TEST(TensorboardTest, MetricsWriterSecondSink) {
  TempDir dir("tb");
  const fs::path tb = dir.path() / kTensorboardDir;
  {
    MetricsWriter w(dir.path(), MetricsWriter::Open::Fresh, true);
    w.write({{"step", 1}, {"loss", 3.0}});
    w.write({{"rollback_to", 0}});  // no step: metrics.jsonl only
    ASSERT_EQ(event_files(tb).size(), 1u);
    EXPECT_EQ(read_tfrecords(w.tensorboard_path()).size(), 2u);
  }
  {
    MetricsWriter w = MetricsWriter::resume(dir.path(), 1, true);  // a new file beside the first
    w.write({{"step", 2}, {"loss", 2.0}});
    const std::vector<std::string> records = read_tfrecords(w.tensorboard_path());
    ASSERT_EQ(records.size(), 3u);  // file version, restart, step 2
    EXPECT_EQ(records[1].substr(9), encode_restart_event(0, 2).substr(9));  // but the wall time
  }
  EXPECT_EQ(event_files(tb).size(), 2u);
  {
    MetricsWriter w(dir.path(), MetricsWriter::Open::Fresh, true);  // a new run: the old files go
  }
  EXPECT_EQ(event_files(tb).size(), 1u);
  {
    // Off: no event file is started, and the earlier run's go all the same.
    MetricsWriter w(dir.path(), MetricsWriter::Open::Fresh);
    w.write({{"step", 1}, {"loss", 3.0}});
    EXPECT_TRUE(w.tensorboard_path().empty());
  }
  EXPECT_EQ(event_files(tb).size(), 0u);
}
