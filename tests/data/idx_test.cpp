#include "data/idx.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "core/check.h"
#include "support/expect_error.h"
#include "support/temp_dir.h"

using namespace moetrain;
using moetrain::testing::read_file_bytes;
using moetrain::testing::TempDir;

namespace {

std::string be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

std::string idx_bytes(uint32_t magic, const std::vector<uint32_t>& dims,
                      const std::string& payload) {
  std::string s = be32(magic);
  for (uint32_t d : dims) s += be32(d);
  return s + payload;
}

std::filesystem::path write_gz(const TempDir& dir, const std::string& name,
                               const std::string& bytes) {
  auto p = dir / name;
  gzFile f = gzopen(p.c_str(), "wb");
  EXPECT_NE(f, nullptr);
  if (!bytes.empty()) {
    EXPECT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), int(bytes.size()));
  }
  EXPECT_EQ(gzclose(f), Z_OK);
  return p;
}

std::string pixels(std::size_t n, uint32_t seed) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 2654435761u + seed) >> 11);
  return s;
}

// The message names the problem and the file.
template <typename Fn>
void expect_error_with(Fn&& fn, std::string_view needle, std::string_view file) {
  moetrain::testing::expect_error(fn, {std::string(needle), std::string(file)});
}

}  // namespace

TEST(Idx, FashionMnistTestSet) {
  ASSERT_TRUE(std::filesystem::is_directory(kFashionMnistDir))
      << "Debian package dataset-fashion-mnist is a project dependency";
  ImageDataset ds = load_fashion_mnist("t10k");
  ASSERT_EQ(ds.n, 10000);
  EXPECT_EQ(ds.rows, 28);
  EXPECT_EQ(ds.cols, 28);
  EXPECT_EQ(ds.num_classes, 10);
  ASSERT_EQ(ds.images.size(), 10000u * 784u);
  ASSERT_EQ(ds.labels.size(), 10000u);
  std::vector<int> hist(10, 0);
  for (int32_t l : ds.labels) ++hist.at(l);
  EXPECT_EQ(hist, std::vector<int>(10, 1000));
  EXPECT_EQ(std::vector<int32_t>(ds.labels.begin(), ds.labels.begin() + 6),
            (std::vector<int32_t>{9, 2, 1, 1, 6, 1}));
  EXPECT_EQ(*std::min_element(ds.images.begin(), ds.images.end()), 0.0f);
  EXPECT_EQ(*std::max_element(ds.images.begin(), ds.images.end()), 1.0f);
  double first = 0;  // the first image's pixel bytes sum to 33456
  for (int i = 0; i < 784; ++i) first += ds.images[i] * 255.0;
  EXPECT_NEAR(first, 33456.0, 1e-2);

  IdxArray train_labels =
      read_idx(std::filesystem::path(kFashionMnistDir) / "train-labels-idx1-ubyte.gz", 1);
  ASSERT_EQ(train_labels.dims, std::vector<uint32_t>{60000});
  std::vector<int> th(10, 0);
  for (uint8_t l : train_labels.data) ++th.at(l);
  EXPECT_EQ(th, std::vector<int>(10, 6000));
  expect_error_with([] { load_fashion_mnist("valid"); }, "split 'valid'", "valid");
}

TEST(Idx, SmallFilesExactValues) {
  TempDir dir("idx");
  const std::string px = pixels(3 * 2 * 4, 5);
  auto img = write_gz(dir, "img.gz", idx_bytes(0x803, {3, 2, 4}, px));
  auto lab = write_gz(dir, "lab.gz", idx_bytes(0x801, {3}, std::string("\x00\x04\x09", 3)));
  ImageDataset ds = load_idx_dataset(img, lab, 10);
  EXPECT_EQ(ds.n, 3);
  EXPECT_EQ(ds.rows, 2);
  EXPECT_EQ(ds.cols, 4);
  EXPECT_EQ(ds.labels, (std::vector<int32_t>{0, 4, 9}));
  ASSERT_EQ(ds.images.size(), px.size());
  for (std::size_t i = 0; i < px.size(); ++i) {
    EXPECT_EQ(ds.images[i], static_cast<float>(static_cast<uint8_t>(px[i])) / 255.0f);
  }
  // Uncompressed IDX reads the same (zlib passes plain files through).
  auto plain = dir.write("plain.idx", idx_bytes(0x801, {3}, std::string("\x00\x04\x09", 3)));
  EXPECT_EQ(read_idx(plain, 1).data, (std::vector<uint8_t>{0, 4, 9}));
  // Zero images is a valid (empty) file.
  auto none = write_gz(dir, "none.gz", idx_bytes(0x803, {0, 28, 28}, ""));
  EXPECT_TRUE(read_idx(none, 3).data.empty());
}

TEST(Idx, CorruptFilesRejected) {
  TempDir dir("idx");
  const std::string px = pixels(50 * 28 * 28, 1);
  const std::string good_raw = idx_bytes(0x803, {50, 28, 28}, px);
  auto good = write_gz(dir, "good.gz", good_raw);
  ASSERT_NO_THROW(read_idx(good, 3));
  auto labels = write_gz(dir, "labels.gz", idx_bytes(0x801, {50}, std::string(50, '\x03')));
  ASSERT_NO_THROW(load_idx_dataset(good, labels, 10));

  auto bad = [&](const std::string& name, const std::string& raw) {
    return write_gz(dir, name, raw);
  };
  expect_error_with(
      [&] {
        read_idx(bad("magic1.gz", idx_bytes(0x801, {50, 28, 28}, px)), 3);
      },
      "magic 0x00000801, expected 0x00000803", "magic1.gz");
  expect_error_with(
      [&] {
        read_idx(bad("magic2.gz", idx_bytes(0x0D03, {50, 28, 28}, px)), 3);
      },
      "magic", "magic2.gz");
  expect_error_with([&] { read_idx(good, 1); }, "magic 0x00000803, expected 0x00000801", "good.gz");
  expect_error_with(
      [&] {
        read_idx(bad("short.gz", idx_bytes(0x803, {51, 28, 28}, px)), 3);
      },
      "payload has 39200 bytes", "short.gz");
  expect_error_with([&] { read_idx(bad("trail.gz", good_raw + "x"), 3); }, "trailing bytes",
                    "trail.gz");
  expect_error_with([&] { read_idx(bad("hdr.gz", be32(0x803) + be32(50)), 3); },
                    "shorter than the 16-byte header", "hdr.gz");
  expect_error_with([&] { read_idx(bad("empty.gz", ""), 3); }, "shorter than", "empty.gz");
  // A header claiming ~800 MB fails on the short payload, without allocating what it claims.
  expect_error_with(
      [&] {
        read_idx(bad("lie.gz", idx_bytes(0x803, {1000000, 28, 28}, px)), 3);
      },
      "payload has", "lie.gz");
  expect_error_with(
      [&] {
        read_idx(bad("huge.gz", idx_bytes(0x803, {0xFFFFFFFF, 0xFFFF, 28}, px)), 3);
      },
      "exceed", "huge.gz");

  // Damage to the compressed stream itself: truncation, and a flipped byte in the deflate body.
  const std::string gz = read_file_bytes(good);
  ASSERT_GT(gz.size(), 1000u);
  auto cut = dir.write("cut.gz", gz.substr(0, gz.size() / 2));
  expect_error_with([&] { read_idx(cut, 3); }, "gzip stream is truncated", "cut.gz");
  // Only the trailer's length field lost: the payload decompresses completely, the stream does not
  // end.
  auto cut_tail = dir.write("cut_tail.gz", gz.substr(0, gz.size() - 4));
  expect_error_with([&] { read_idx(cut_tail, 3); }, "gzip stream is truncated", "cut_tail.gz");
  auto crc = dir.write("crc.gz", gz.substr(0, gz.size() - 8) + std::string("\x01\x02\x03\x04", 4) +
                                     gz.substr(gz.size() - 4));
  expect_error_with([&] { read_idx(crc, 3); }, "gzip stream is damaged (incorrect data check)",
                    "crc.gz");
  for (std::size_t at : {std::size_t{20}, gz.size() / 3, gz.size() / 2, gz.size() - 12}) {
    std::string flipped = gz;
    flipped[at] = static_cast<char>(flipped[at] ^ 0x5A);
    auto p = dir.write("flip" + std::to_string(at) + ".gz", flipped);
    // Damaged deflate data shows up as a zlib error, a CRC mismatch or a wrong payload length.
    expect_error_with([&] { read_idx(p, 3); }, "IDX file", p.filename().string());
  }
  auto garbage = dir.write("garbage.gz", gz + "junk");
  expect_error_with([&] { read_idx(garbage, 3); }, "4 bytes of garbage after the gzip stream",
                    "garbage.gz");
  // Two gzip members are one stream (as gzip -d reads them): header+half the payload, then the
  // rest.
  const std::string first = read_file_bytes(write_gz(dir, "m1.gz", good_raw.substr(0, 10000)));
  const std::string second = read_file_bytes(write_gz(dir, "m2.gz", good_raw.substr(10000)));
  auto members = dir.write("members.gz", first + second);
  EXPECT_EQ(read_idx(members, 3).data, read_idx(good, 3).data);

  // Dataset-level checks.
  auto few = write_gz(dir, "few.gz", idx_bytes(0x801, {49}, std::string(49, '\x03')));
  expect_error_with([&] { load_idx_dataset(good, few, 10); }, "disagree on the count", "few.gz");
  auto high = write_gz(dir, "high.gz", idx_bytes(0x801, {50}, std::string(49, '\x03') + "\x0A"));
  expect_error_with([&] { load_idx_dataset(good, high, 10); },
                    "label 10 of example 49 is not below 10", "high.gz");
  expect_error_with([&] { read_idx(dir / "missing.gz", 3); }, "does not exist", "missing.gz");
}
