// Checkpoints on real files in one process: CRC-32C against published answers, pieces by global
// name and range read back in any cut, and every way a checkpoint can be broken on disk (a flipped
// byte, a truncated shard, no manifest, a leftover temporary directory) refused in favour of the
// previous complete one.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <limits>
#include <vector>

#include "core/check.h"
#include "io/checkpoint.h"
#include "io/crc32c.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "support/expect_error.h"
#include "support/resign.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

// RFC 3720 (iSCSI) appendix B.4 and the classic check value.
struct KnownAnswer {
  std::vector<uint8_t> bytes;
  uint32_t crc;
};

std::vector<KnownAnswer> known_answers() {
  std::vector<KnownAnswer> out;
  const std::string digits = "123456789";
  out.push_back({{digits.begin(), digits.end()}, 0xE3069283u});
  out.push_back({std::vector<uint8_t>(32, 0x00), 0x8A9136AAu});
  out.push_back({std::vector<uint8_t>(32, 0xFF), 0x62A8AB43u});
  std::vector<uint8_t> up(32), down(32);
  for (int i = 0; i < 32; ++i)
    up[i] = static_cast<uint8_t>(i), down[i] = static_cast<uint8_t>(31 - i);
  out.push_back({up, 0x46DD794Eu});
  out.push_back({down, 0x113FDB5Cu});
  out.push_back({{}, 0u});
  return out;
}

void flip_byte(const fs::path& p, std::uintmax_t at) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

// A small "model": two parameters, their AdamW-like moments, one state tensor.
struct Tensors {
  std::vector<float> w, b, m_w, m_b, bias;
  explicit Tensors(float base) : w(6 * 5), b(7), m_w(w.size()), m_b(b.size()), bias(4) {
    auto fill = [&](std::vector<float>& v, float k) {
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = base + k + 0.25f * static_cast<float>(i);
    };
    fill(w, 0), fill(b, 100), fill(m_w, 200), fill(m_b, 300), fill(bias, 400);
  }
  // Optimizer state written as slices (as ZeRO-1 shards cut it).
  CheckpointShare share() {
    CheckpointShare s;
    s.model = {whole_tensor("w", {6, 5}, w.data()), whole_tensor("b", {7}, b.data())};
    s.optimizer = {{"m.w", {6, 5}, 0, 13, m_w.data()},
                   {"m.w", {6, 5}, 13, 30, m_w.data() + 13},
                   {"m.b", {7}, 0, 7, m_b.data()}};
    s.state = {whole_tensor("bias", {4}, bias.data())};
    return s;
  }
};

fs::path write(const fs::path& run, int64_t step, Tensors& t, int64_t keep = 3) {
  auto comm = make_local_comm();
  return write_checkpoint(*comm, run, step, t.share(), {{{"model_type", "test"}}, {{"step", step}}, {}},
                          keep);
}

}  // namespace

TEST(Crc32c, KnownAnswersFromBothImplementations) {
  for (const auto& k : known_answers()) {
    EXPECT_EQ(crc32c(k.bytes.data(), k.bytes.size()), k.crc) << k.bytes.size();
    EXPECT_EQ(crc32c_table(k.bytes.data(), k.bytes.size()), k.crc) << k.bytes.size();
    if (crc32c_hardware_available()) {
      EXPECT_EQ(crc32c_hardware(k.bytes.data(), k.bytes.size()), k.crc) << k.bytes.size();
    }
  }
}

TEST(Crc32c, IncrementalAndUnalignedAgreeWithTheTable) {
  std::mt19937 gen(7);
  std::vector<uint8_t> data(4099);
  for (auto& v : data) v = static_cast<uint8_t>(gen());
  const uint32_t whole = crc32c_table(data.data(), data.size());
  for (std::size_t split : {0, 1, 7, 8, 9, 1000, 4098, 4099}) {
    uint32_t c = crc32c(data.data(), split);
    EXPECT_EQ(crc32c(data.data() + split, data.size() - split, c), whole) << split;
  }
  for (std::size_t off = 0; off < 9; ++off)
    for (std::size_t n : {0, 1, 5, 8, 15, 64, 1001}) {
      const uint32_t want = crc32c_table(data.data() + off, n);
      EXPECT_EQ(crc32c(data.data() + off, n), want) << off << " " << n;
    }
  // One flipped bit changes the checksum.
  data[2000] ^= 1;
  EXPECT_NE(crc32c(data.data(), data.size()), whole);
}

TEST(Crc32c, LongInputsTakeThreeStreamsAndAgreeWithTheTable) {
  // Above 3 × 8 KiB the hardware path joins three side-by-side streams; around and across that
  // size, at odd offsets and continued from a previous CRC, it must give the table's value.
  std::mt19937 gen(11);
  std::vector<uint8_t> data(200003);
  for (auto& v : data) v = static_cast<uint8_t>(gen());
  for (std::size_t off : {0, 3})
    for (std::size_t n : {24575, 24576, 24577, 49152 + 5, 100000, 199999}) {
      const uint32_t want = crc32c_table(data.data() + off, n);
      EXPECT_EQ(crc32c(data.data() + off, n), want) << off << " " << n;
      const uint32_t head = crc32c(data.data(), off + 17);
      EXPECT_EQ(crc32c(data.data() + off + 17, n, head), crc32c_table(data.data(), off + 17 + n))
          << off << " " << n;
    }
}

TEST(Checkpoint, PiecesReadBackInAnyCut) {
  TempDir tmp("ckpt_pieces");
  Tensors t(1.0f);
  fs::path dir = write(tmp.path(), 5, t);
  EXPECT_EQ(dir, checkpoint_dir(tmp.path(), 5));
  EXPECT_EQ(find_latest_checkpoint(tmp.path()), dir);
  // One writer: a plain model.safetensors with whole tensors under their names, as transformers
  // reads it; the optimizer slices under ranged keys.
  SafetensorsReader model(dir / "model.safetensors");
  EXPECT_EQ(model.shape("w"), (Shape{6, 5}));
  EXPECT_EQ(model.metadata().at("format"), "pt");
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  SafetensorsReader opt(dir / "optimizer.safetensors");
  EXPECT_TRUE(opt.contains("m.w[0:13]"));
  EXPECT_TRUE(opt.contains("m.w[13:30]"));
  nlohmann::json manifest = read_checkpoint_json(dir, "manifest.json");
  EXPECT_EQ(manifest["version"], 2);
  EXPECT_EQ(manifest["checksum"], "crc32c");
  EXPECT_EQ(manifest["tensors"]["optimizer"]["m.w"]["pieces"].size(), 2u);

  // Ranges that cross the saved slices, and whole tensors.
  std::vector<float> part(20), whole_w(30), bias(4);
  CheckpointShare want;
  want.optimizer = {{"m.w", {6, 5}, 5, 25, part.data()}};
  want.model = {whole_tensor("w", {6, 5}, whole_w.data())};
  want.state = {whole_tensor("bias", {4}, bias.data())};
  read_checkpoint_pieces(dir, want);
  EXPECT_EQ(0, std::memcmp(part.data(), t.m_w.data() + 5, 20 * sizeof(float)));
  EXPECT_EQ(whole_w, t.w);
  EXPECT_EQ(bias, t.bias);

  // The one-process API reads the same.
  std::vector<float> b(7), m_b(7);
  CheckpointContents c;
  c.model = {{"b", {7}, b.data()}};
  c.optimizer = {{"m.b", {7}, m_b.data()}};
  read_checkpoint(dir, c);
  EXPECT_EQ(b, t.b);
  EXPECT_EQ(m_b, t.m_b);
  EXPECT_EQ(c.config["model_type"], "test");
  EXPECT_EQ(c.trainer["step"], 5);
}

TEST(Checkpoint, WrongNamesShapesAndRangesAreClearErrors) {
  TempDir tmp("ckpt_names");
  Tensors t(1.0f);
  fs::path dir = write(tmp.path(), 1, t);
  std::vector<float> buf(64);
  CheckpointShare missing;
  missing.model = {whole_tensor("v", {7}, buf.data())};
  expect_error([&] { read_checkpoint_pieces(dir, missing); }, "no model tensor 'v'");
  CheckpointShare shape;
  shape.model = {whole_tensor("w", {5, 6}, buf.data())};
  expect_error([&] { read_checkpoint_pieces(dir, shape); }, "has shape (6, 5), this run expects");

  // Pieces that leave a gap are never committed: nothing on disk changes.
  CheckpointShare gap = t.share();
  gap.optimizer.erase(gap.optimizer.begin() + 1);
  auto comm = make_local_comm();
  expect_error([&] { write_checkpoint(*comm, tmp.path(), 2, gap, {}, 3); }, "'m.w'");
  EXPECT_FALSE(fs::exists(checkpoint_dir(tmp.path(), 2)));
  EXPECT_EQ(find_latest_checkpoint(tmp.path()), dir);
  // A model tensor in part would not load in transformers.
  CheckpointShare partial = t.share();
  partial.model[0].end = 10;
  expect_error([&] { write_checkpoint(*comm, tmp.path(), 2, partial, {}, 3); }, "written in part");
}

TEST(Checkpoint, EveryKindOfDamageFallsBackToThePreviousCheckpoint) {
  TempDir tmp("ckpt_damage");
  for (int64_t step = 1; step <= 4; ++step) {
    Tensors t(static_cast<float>(step));
    write(tmp.path(), step, t, /*keep=*/4);
  }
  auto expect_latest = [&](int64_t step) {
    auto latest = find_latest_checkpoint(tmp.path());
    ASSERT_TRUE(latest);
    EXPECT_EQ(*latest, checkpoint_dir(tmp.path(), step));
  };
  expect_latest(4);
  // A leftover temporary directory of a later step (a writer that died before its commit), even
  // one with a manifest, is never a candidate.
  fs::path leftover = tmp.path() / "checkpoints" / ".tmp_step_00000005";
  fs::copy(checkpoint_dir(tmp.path(), 4), leftover);
  expect_latest(4);

  // A flipped byte in a shard.
  const fs::path step4 = checkpoint_dir(tmp.path(), 4);
  flip_byte(step4 / "optimizer.safetensors", fs::file_size(step4 / "optimizer.safetensors") - 9);
  expect_error([&] { verify_checkpoint(step4); }, "CRC-32C");
  expect_latest(3);
  // A truncated shard.
  const fs::path step3 = checkpoint_dir(tmp.path(), 3);
  fs::resize_file(step3 / "model.safetensors", fs::file_size(step3 / "model.safetensors") - 4);
  expect_error([&] { verify_checkpoint(step3); }, "truncated");
  expect_latest(2);
  // No metadata: uncommitted.
  const fs::path step2 = checkpoint_dir(tmp.path(), 2);
  fs::remove(step2 / "manifest.json");
  expect_error([&] { verify_checkpoint(step2); }, "uncommitted");
  expect_latest(1);
  // A file listed in the manifest that is gone.
  const fs::path step1 = checkpoint_dir(tmp.path(), 1);
  fs::remove(step1 / "state.safetensors");
  expect_error([&] { verify_checkpoint(step1); }, "missing");
  EXPECT_FALSE(find_latest_checkpoint(tmp.path()));

  // The next checkpoint commits normally, removes the dead temporary directory and keeps K.
  Tensors t(9.0f);
  write(tmp.path(), 5, t, /*keep=*/2);
  EXPECT_FALSE(fs::exists(leftover));
  expect_latest(5);
  EXPECT_TRUE(fs::exists(step4));
  EXPECT_FALSE(fs::exists(step3));
}

// `latest` is a link to the newest checkpoint, so the path opens as it; extra files (a tokenizer)
// are checksummed like the rest.
TEST(Checkpoint, LatestIsALinkAndExtraFilesAreChecksummed) {
  TempDir tmp("ckpt_link");
  auto comm = make_local_comm();
  Tensors t(1.0f);
  for (int64_t step : {1, 2}) {
    CheckpointDocs docs{{{"model_type", "test"}}, {{"step", step}}, {{"tokenizer.model", "pieces"}}};
    write_checkpoint(*comm, tmp.path(), step, t.share(), docs, 3);
  }
  const fs::path latest = tmp.path() / "checkpoints" / "latest";
  ASSERT_TRUE(fs::is_symlink(latest));
  EXPECT_EQ(fs::read_symlink(latest), "step_00000002");
  EXPECT_EQ(fs::canonical(latest), fs::canonical(checkpoint_dir(tmp.path(), 2)));
  verify_checkpoint(latest);
  EXPECT_EQ(read_file_bytes(latest / "tokenizer.model"), "pieces");
  EXPECT_EQ(find_latest_checkpoint(tmp.path()), checkpoint_dir(tmp.path(), 2));
  // A copy of the run whose copier followed the link: `latest` is a directory, replaced by the link.
  const fs::path copy = tmp.path() / "copy";
  fs::create_directories(copy);
  fs::copy(tmp.path() / "checkpoints", copy / "checkpoints", fs::copy_options::recursive);
  ASSERT_TRUE(fs::is_directory(fs::symlink_status(copy / "checkpoints" / "latest")));
  CheckpointDocs docs{{{"model_type", "test"}}, {{"step", 3}}, {}};
  write_checkpoint(*comm, copy, 3, t.share(), docs, 3);
  EXPECT_EQ(fs::read_symlink(copy / "checkpoints" / "latest"), "step_00000003");
  EXPECT_EQ(find_latest_checkpoint(copy), checkpoint_dir(copy, 3));

  flip_byte(latest / "tokenizer.model", 2);
  expect_error([&] { verify_checkpoint(checkpoint_dir(tmp.path(), 2)); },
               {"tokenizer.model", "CRC-32C"});
  EXPECT_EQ(find_latest_checkpoint(tmp.path()), checkpoint_dir(tmp.path(), 1));
}

TEST(Checkpoint, KeepsTheNewestKAndNeverRemovesANewerCheckpoint) {
  TempDir tmp("ckpt_keep");
  for (int64_t step : {2, 4, 6}) {
    Tensors t(static_cast<float>(step));
    write(tmp.path(), step, t, /*keep=*/2);
  }
  EXPECT_FALSE(fs::exists(checkpoint_dir(tmp.path(), 2)));
  EXPECT_TRUE(fs::exists(checkpoint_dir(tmp.path(), 4)));
  // Checkpointed at 5 while step 6 exists (it could not be verified at the resume): 6 is kept and
  // not counted, 4 and 5 are the newest two up to 5.
  Tensors t(5.0f);
  write(tmp.path(), 5, t, /*keep=*/2);
  EXPECT_TRUE(fs::exists(checkpoint_dir(tmp.path(), 6)));
  EXPECT_TRUE(fs::exists(checkpoint_dir(tmp.path(), 4)));
  EXPECT_EQ(find_latest_checkpoint(tmp.path()), checkpoint_dir(tmp.path(), 6));
  // Rewriting a step replaces it whole.
  Tensors again(50.0f);
  write(tmp.path(), 5, again, /*keep=*/2);
  std::vector<float> w(30);
  CheckpointShare want;
  want.model = {whole_tensor("w", {6, 5}, w.data())};
  read_checkpoint_pieces(checkpoint_dir(tmp.path(), 5), want);
  EXPECT_EQ(w, again.w);
}

// A full disk at the write of `latest` leaves it at step 5 while step 10 is committed: the
// resume takes 10, and rotation after a resume from an older step never removes 10.
TEST(Checkpoint, StaleLatestNeitherHidesNorRotatesOutANewerCommittedCheckpoint) {
  TempDir tmp("ckpt_stale");
  Tensors five(5.0f), ten(10.0f);
  write(tmp.path(), 5, five, /*keep=*/3);
  write(tmp.path(), 10, ten, /*keep=*/3);
  write_file_atomic(tmp.path() / "checkpoints" / "latest", "step_00000005\n");
  EXPECT_EQ(find_latest_checkpoint(tmp.path()), checkpoint_dir(tmp.path(), 10));

  Tensors seven(7.0f);
  write(tmp.path(), 7, seven, /*keep=*/1);
  EXPECT_TRUE(fs::exists(checkpoint_dir(tmp.path(), 10)));
  EXPECT_FALSE(fs::exists(checkpoint_dir(tmp.path(), 5)));
  EXPECT_EQ(find_latest_checkpoint(tmp.path()), checkpoint_dir(tmp.path(), 10));
}

// `latest` naming a checkpoint of another run (relative or absolute) is refused with a warning;
// the run's own newest checkpoint is taken.
TEST(Checkpoint, LatestOutsideTheRunDirectoryIsRefused) {
  TempDir tmp("ckpt_escape");
  const fs::path run = tmp.path() / "run", other = tmp.path() / "other";
  Tensors mine(5.0f), theirs(10.0f);
  write(run, 5, mine);
  write(other, 10, theirs);
  for (const std::string& hint :
       {std::string("../../other/checkpoints/step_00000010"), checkpoint_dir(other, 10).string()}) {
    write_file_atomic(run / "checkpoints" / "latest", hint + "\n");
    ::testing::internal::CaptureStderr();
    const auto found = find_latest_checkpoint(run);
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(found, checkpoint_dir(run, 5)) << hint;
    EXPECT_NE(log.find("'" + hint + "' is not a checkpoint of this run directory"),
              std::string::npos)
        << log;
  }
}

namespace {

std::string latest_with_log(const fs::path& run, std::optional<fs::path>& found,
                            const CheckpointLoad& load = {}) {
  ::testing::internal::CaptureStderr();
  found = find_latest_checkpoint(run, nullptr, load);
  return ::testing::internal::GetCapturedStderr();
}

}  // namespace

// A re-signed trainer_state.json (bad JSON, or a step the manifest does not name) and a manifest
// whose step is not its directory's: each is a corrupt checkpoint, and the previous one is taken
// with a warning naming the file.
TEST(Checkpoint, StepsThatDisagreeOrStateThatDoesNotParseFallBack) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"trainer_state.json", "{\"step\": 999}"},
      {"trainer_state.json", "{\"step\": "},
      {"manifest.json", ""}};
  for (const auto& [file, text] : cases) {
    TempDir tmp("ckpt_resigned");
    Tensors five(5.0f), ten(10.0f);
    write(tmp.path(), 5, five);
    const fs::path dir = write(tmp.path(), 10, ten);
    if (file == "manifest.json") {
      nlohmann::json m = read_checkpoint_json(dir, "manifest.json");
      m["step"] = 999;
      std::ofstream(dir / "manifest.json", std::ios::binary | std::ios::trunc) << m.dump(2);
    } else {
      resign_checkpoint_file(dir, file, text);
    }
    std::optional<fs::path> found;
    const std::string log = latest_with_log(tmp.path(), found);
    EXPECT_EQ(found, checkpoint_dir(tmp.path(), 5)) << file << " " << text << "\n" << log;
    EXPECT_NE(log.find((dir / file).string()), std::string::npos) << log;
  }
}

// A manifest whose tensors do not match what the reader needs: the load fails, the previous
// checkpoint is taken.
TEST(Checkpoint, ACheckpointThatFailsToLoadFallsBackToThePreviousOne) {
  TempDir tmp("ckpt_noload");
  Tensors five(5.0f), ten(10.0f);
  write(tmp.path(), 5, five);
  const fs::path dir = write(tmp.path(), 10, ten);
  nlohmann::json m = read_checkpoint_json(dir, "manifest.json");
  m["tensors"]["model"]["w_renamed"] = m["tensors"]["model"]["w"];
  m["tensors"]["model"].erase("w");
  std::ofstream(dir / "manifest.json", std::ios::binary | std::ios::trunc) << m.dump(2);
  std::vector<float> w(30);
  auto load = [&](const fs::path& c) {
    CheckpointShare want;
    want.model = {whole_tensor("w", {6, 5}, w.data())};
    read_checkpoint_pieces(c, want);
  };
  std::optional<fs::path> found;
  const std::string log = latest_with_log(tmp.path(), found, load);
  EXPECT_EQ(found, checkpoint_dir(tmp.path(), 5)) << log;
  EXPECT_NE(log.find("refusing checkpoint " + dir.string()), std::string::npos) << log;
  EXPECT_EQ(w, five.w);
}

// A checkpoint whose checksums pass but whose weights hold a NaN (written by a run that had
// diverged, or by another tool) is refused by tensor as it loads.
TEST(Checkpoint, NonFiniteValuesAreRefusedByTensor) {
  TempDir tmp("ckpt_nan");
  Tensors t(1.0f);
  t.m_w[20] = std::numeric_limits<float>::infinity();
  fs::path dir = write(tmp.path(), 1, t);
  Tensors back(0.0f);
  expect_error([&] { read_checkpoint_pieces(dir, back.share()); },
               {"'m.w'", "1 non-finite", "element 20 is inf"});
}
