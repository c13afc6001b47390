#include "io/safetensors.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <vector>

#include "core/check.h"
#include "core/rng.h"
#include "support/temp_dir.h"

using namespace moetrain;
using moetrain::testing::read_file_bytes;
using moetrain::testing::TempDir;

namespace {

// A file image from a header (padded here like the reference writer) and a data section.
std::string build_file(std::string header, std::string_view data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  uint64_t n = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + header + std::string(data);
}

template <typename T>
std::string le_bytes(std::initializer_list<T> values) {
  std::string s;
  for (T v : values) s.append(reinterpret_cast<const char*>(&v), sizeof(T));
  return s;
}

// Loading `p` must throw moetrain::Error mentioning `needle` and the file.
void expect_rejected(const std::filesystem::path& p, std::string_view needle) {
  try {
    SafetensorsReader r(p);
    ADD_FAILURE() << "loaded a corrupt file " << p << ", expected an error with '" << needle << "'";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(needle), std::string::npos)
        << "message: " << msg << "\nexpected to contain: " << needle;
    EXPECT_NE(msg.find(p.filename().string()), std::string::npos)
        << "message does not name the file: " << msg;
  }
}

// The fixture, byte for byte: the format as the reference Python writer produces it (compact JSON,
// "__metadata__" first, one space of padding up to 192 = 0xC0, little-endian data).
const char kFixtureHeader[] =
    R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},)"
    R"("b":{"dtype":"I32","shape":[3],"data_offsets":[8,20]},"c":{"dtype":"BF16","shape":[2],"data_offsets":[20,24]}} )";

std::string fixture_bytes() {
  std::string out = std::string("\xC0\0\0\0\0\0\0\0", 8) + kFixtureHeader;
  const unsigned char data[] = {0x00, 0x00, 0xC0, 0x3F, 0x00, 0x00, 0x00, 0x40,  // a: 1.5, 2.0
                                0x01, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00,  // b: 1, 2,
                                0x03, 0x00, 0x00, 0x00,                          //    3
                                0x80, 0x3F, 0x00, 0xC0};  // c: bf16 1.0, -2.0
  out.append(reinterpret_cast<const char*>(data), sizeof(data));
  return out;
}

SafetensorsWriter fixture_writer(const float* a, const int32_t* b, const bf16* c) {
  SafetensorsWriter w;
  w.add("a", SafetensorsDType::F32, {1, 2}, a);
  w.add("b", SafetensorsDType::I32, {3}, b);
  w.add("c", SafetensorsDType::BF16, {2}, c);
  w.set_metadata("k", "v");
  return w;
}

// Our writer produces the fixture exactly, and our reader reads it back.
void check_hand_built_fixture(const TempDir& dir) {
  const float a[] = {1.5f, 2.0f};
  const int32_t b[] = {1, 2, 3};
  const bf16 c[] = {bf16(1.0f), bf16(-2.0f)};
  const std::string expected = fixture_bytes();
  ASSERT_EQ(expected.size(), 224u);
  auto w = fixture_writer(a, b, c);
  EXPECT_EQ(w.serialize(), expected);
  auto path = dir / "ours.safetensors";
  w.write(path);
  EXPECT_EQ(read_file_bytes(path), expected);

  SafetensorsReader r(dir.write("fixture.safetensors", expected));
  EXPECT_EQ(r.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(r.metadata().at("k"), "v");
  EXPECT_EQ(r.read_f32("a"), (std::vector<float>{1.5f, 2.0f}));
  EXPECT_EQ(r.read_f32("c", true), (std::vector<float>{1.0f, -2.0f}));
  int32_t got_b[3];
  r.copy_bytes("b", got_b, sizeof(got_b));
  EXPECT_EQ(std::vector<int32_t>(got_b, got_b + 3), (std::vector<int32_t>{1, 2, 3}));
}

bool python_safetensors_available() {
  return std::system("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") == 0;
}

int run_command(const std::string& cmd) {
  int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// Writes (mode "write") or checks (mode "check") the interop tensors with the reference library.
const char kPythonScript[] = R"PY(
import sys
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

mode, path = sys.argv[1], sys.argv[2]
expected = {
    "x_i64": np.array([7, -3], dtype=np.int64),
    "y_f64": np.array([[1.5, -2.25], [1e300, 0.0]], dtype=np.float64),
    "a": np.zeros((2, 0), dtype=np.float32),
    "w": (np.arange(12, dtype=np.float32) * 0.5 - 2).reshape(3, 4),
    "z_ids": np.array([0, 1, -1, 2**31 - 1, -2**31], dtype=np.int32),
    "b16": np.array([1.0, 2.0, -0.5], dtype=np.float16),
    "z_u8": np.array([1, 2, 255], dtype=np.uint8),
    "scalar": np.array(3.25, dtype=np.float32),
}
meta = {"note": "h\u00e9llo w\u00f6rld"}
if mode == "write":
    save_file(expected, path, metadata=meta)
else:
    got = load_file(path)
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    for k, v in expected.items():
        g = got[k]
        assert g.dtype == v.dtype and g.shape == v.shape and np.array_equal(g, v), (k, g, v)
    with safe_open(path, framework="numpy") as f:
        assert f.metadata() == meta, f.metadata()
print("python check ok")
)PY";

}  // namespace

TEST(Safetensors, RoundTripF32Bf16I32AndMetadata) {
  TempDir dir("st");
  std::vector<float> w(5 * 7);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.25f * static_cast<float>(i) - 3.0f;
  std::vector<bf16> h(9);
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = bf16(1.0f / static_cast<float>(i + 1));
  std::vector<int32_t> ids = {0, -1, 2147483647, -2147483647 - 1, 42};
  Tensor t({3, 2}, DType::F32);
  for (int i = 0; i < 6; ++i) t.f32()[i] = static_cast<float>(i * i);
  const float scalar = -7.5f;

  SafetensorsWriter wr;
  wr.add("model.w", SafetensorsDType::F32, {5, 7}, w.data());
  wr.add("h", SafetensorsDType::BF16, {3, 3}, h.data());
  wr.add("empty", SafetensorsDType::F32, {0, 4}, nullptr);
  wr.add("ids", SafetensorsDType::I32, {5}, ids.data());
  wr.add("tensor", t);
  wr.add("scalar", SafetensorsDType::F32, {}, &scalar);
  wr.add_bytes("odd", SafetensorsDType::U8, {3}, {1, 2, 3});
  wr.add("after_odd", SafetensorsDType::BF16, {2}, h.data());  // lands at an odd offset
  wr.set_metadata("format", "pt");
  wr.set_metadata("step", "12");
  auto path = dir / "model.safetensors";
  wr.write(path);
  EXPECT_FALSE(std::filesystem::exists(dir / "model.safetensors.tmp"));
  EXPECT_EQ(wr.header().size() % 8, 0u);

  SafetensorsReader r(path);
  EXPECT_EQ(r.names(), (std::vector<std::string>{"model.w", "h", "empty", "ids", "tensor", "scalar",
                                                 "odd", "after_odd"}));
  EXPECT_EQ(r.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}));
  EXPECT_EQ(r.dtype("model.w"), SafetensorsDType::F32);
  EXPECT_EQ(r.shape("model.w"), (Shape{5, 7}));
  EXPECT_EQ(r.read_f32("model.w"), w);
  EXPECT_EQ(r.shape("empty"), (Shape{0, 4}));
  EXPECT_TRUE(r.read_f32("empty").empty());
  EXPECT_EQ(r.shape("scalar"), Shape{});
  EXPECT_EQ(r.read_f32("scalar"), std::vector<float>{scalar});

  auto hf = r.read_f32("h", /*convert_bf16=*/true);
  ASSERT_EQ(hf.size(), h.size());
  for (std::size_t i = 0; i < h.size(); ++i) EXPECT_EQ(hf[i], h[i].to_float());
  auto odd = r.read_f32("after_odd", true);
  EXPECT_EQ(odd, (std::vector<float>{h[0].to_float(), h[1].to_float()}));
  Tensor hb = r.load_tensor("h");
  EXPECT_EQ(hb.dtype(), DType::BF16);
  EXPECT_EQ(std::memcmp(hb.raw(), h.data(), 18), 0);
  Tensor tt = r.load_tensor("tensor");
  EXPECT_EQ(tt.shape(), (Shape{3, 2}));
  EXPECT_EQ(std::memcmp(tt.raw(), t.raw(), 24), 0);

  std::vector<int32_t> got(5);
  r.copy_bytes("ids", got.data(), 20);
  EXPECT_EQ(got, ids);
  auto span = r.bytes("odd");
  EXPECT_EQ(std::vector<uint8_t>(span.begin(), span.end()), (std::vector<uint8_t>{1, 2, 3}));

  // Asking for the wrong thing is an error, never a reinterpretation.
  EXPECT_THROW(r.read_f32("h"), Error);          // BF16 without asking for widening
  EXPECT_THROW(r.read_f32("ids", true), Error);  // I32 is not a float
  EXPECT_THROW(r.entry("nope"), Error);
  EXPECT_THROW(r.copy_bytes("ids", got.data(), 16), Error);
  EXPECT_THROW(r.load_tensor("ids"), Error);
  std::vector<float> small(3);
  EXPECT_THROW(r.copy_to_f32("model.w", small.data(), 3), Error);
}

TEST(Safetensors, OverwriteIsAtomic) {
  TempDir dir("st");
  auto path = dir / "x.safetensors";
  const float one = 1.0f, two = 2.0f;
  SafetensorsWriter w1;
  w1.add("x", SafetensorsDType::F32, {1}, &one);
  w1.write(path);
  {
    // An interrupted write (the writer dies before commit) leaves the old file and no temporary.
    AtomicFileWriter half(path);
    half.write("garbage", 7);
    EXPECT_TRUE(std::filesystem::exists(dir / "x.safetensors.tmp"));
    EXPECT_EQ(SafetensorsReader(path).read_f32("x"), std::vector<float>{1.0f});
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "x.safetensors.tmp"));
  EXPECT_EQ(SafetensorsReader(path).read_f32("x"), std::vector<float>{1.0f});
  SafetensorsWriter w2;
  w2.add("x", SafetensorsDType::F32, {1}, &two);
  w2.write(path);
  EXPECT_EQ(SafetensorsReader(path).read_f32("x"), std::vector<float>{2.0f});
  EXPECT_THROW(w2.write(dir / "no_such_dir" / "y.safetensors"), Error);
}

TEST(Safetensors, WriterRejectsBadInput) {
  SafetensorsWriter w;
  const float x[2] = {1, 2};
  w.add("x", SafetensorsDType::F32, {2}, x);
  EXPECT_THROW(w.add("x", SafetensorsDType::F32, {2}, x), Error);             // duplicate
  EXPECT_THROW(w.add("__metadata__", SafetensorsDType::F32, {2}, x), Error);  // reserved
  EXPECT_THROW(w.add("neg", SafetensorsDType::F32, {-1}, x), Error);
  EXPECT_THROW(w.add("null", SafetensorsDType::F32, {2}, nullptr), Error);
  EXPECT_THROW(w.add_bytes("short", SafetensorsDType::F32, {2}, {1, 2, 3}), Error);
  EXPECT_EQ(w.num_tensors(), 1u);
}

TEST(Safetensors, HandBuiltBytesFixture) {
  TempDir dir("st");
  check_hand_built_fixture(dir);
}

TEST(Safetensors, InteropWithPythonReference) {
  TempDir dir("st");
  if (!python_safetensors_available()) {
    // No reference library here: the byte-exact fixture (the reference's own layout) stands in.
    std::cout
        << "python3 with safetensors+numpy not found: checking against the hand-built fixture\n";
    check_hand_built_fixture(dir);
    return;
  }
  auto script = dir.write("interop.py", kPythonScript);

  // Python writes, we read and check every value.
  auto ref = dir / "ref.safetensors";
  ASSERT_EQ(run_command("python3 " + script.string() + " write " + ref.string()), 0);
  SafetensorsReader r(ref);
  EXPECT_EQ(r.size(), 8u);
  EXPECT_EQ(r.metadata().at("note"), "h\xC3\xA9llo w\xC3\xB6rld");
  int64_t i64[2];
  r.copy_bytes("x_i64", i64, sizeof(i64));
  EXPECT_EQ(i64[0], 7);
  EXPECT_EQ(i64[1], -3);
  double f64[4];
  r.copy_bytes("y_f64", f64, sizeof(f64));
  EXPECT_EQ(f64[0], 1.5);
  EXPECT_EQ(f64[2], 1e300);
  EXPECT_EQ(r.shape("y_f64"), (Shape{2, 2}));
  EXPECT_EQ(r.shape("a"), (Shape{2, 0}));
  auto wv = r.read_f32("w");
  ASSERT_EQ(wv.size(), 12u);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(wv[i], 0.5f * static_cast<float>(i) - 2.0f);
  int32_t ids[5];
  r.copy_bytes("z_ids", ids, sizeof(ids));
  EXPECT_EQ(ids[3], 2147483647);
  EXPECT_EQ(ids[4], -2147483647 - 1);
  uint16_t f16[3];
  r.copy_bytes("b16", f16, sizeof(f16));
  EXPECT_EQ(f16[0], 0x3C00);
  EXPECT_EQ(f16[2], 0xB800);
  EXPECT_EQ(r.dtype("z_u8"), SafetensorsDType::U8);
  EXPECT_EQ(r.read_f32("scalar"), std::vector<float>{3.25f});
  EXPECT_EQ(r.shape("scalar"), Shape{});

  // The same tensors in the reference's layout order: our bytes equal the reference's bytes.
  SafetensorsWriter same;
  for (const auto& name : r.names()) {
    auto b = r.bytes(name);
    same.add_bytes(name, r.dtype(name), r.shape(name), std::vector<uint8_t>(b.begin(), b.end()));
  }
  same.set_metadata("note", "h\xC3\xA9llo w\xC3\xB6rld");
  EXPECT_EQ(same.serialize(), read_file_bytes(ref));

  // We write (from our own values, in our own order), Python reads and checks every value.
  const int64_t x_i64[] = {7, -3};
  const double y_f64[] = {1.5, -2.25, 1e300, 0.0};
  float w[12];
  for (int i = 0; i < 12; ++i) w[i] = 0.5f * static_cast<float>(i) - 2.0f;
  const int32_t z_ids[] = {0, 1, -1, 2147483647, -2147483647 - 1};
  const uint16_t b16[] = {0x3C00, 0x4000, 0xB800};
  const uint8_t z_u8[] = {1, 2, 255};
  const float scalar = 3.25f;
  SafetensorsWriter ours;
  ours.add("z_u8", SafetensorsDType::U8, {3}, z_u8);
  ours.add("w", SafetensorsDType::F32, {3, 4}, w);
  ours.add("b16", SafetensorsDType::F16, {3}, b16);
  ours.add("x_i64", SafetensorsDType::I64, {2}, x_i64);
  ours.add("a", SafetensorsDType::F32, {2, 0}, nullptr);
  ours.add("scalar", SafetensorsDType::F32, {}, &scalar);
  ours.add("y_f64", SafetensorsDType::F64, {2, 2}, y_f64);
  ours.add("z_ids", SafetensorsDType::I32, {5}, z_ids);
  ours.set_metadata("note", "h\xC3\xA9llo w\xC3\xB6rld");
  auto mine = dir / "ours.safetensors";
  ours.write(mine);
  EXPECT_EQ(run_command("python3 " + script.string() + " check " + mine.string()), 0);
}

TEST(Safetensors, CorruptFilesRejected) {
  TempDir dir("st");
  const float a[] = {1.5f, 2.0f};
  const int32_t b[] = {1, 2, 3};
  const bf16 c[] = {bf16(1.0f), bf16(-2.0f)};
  const std::string good = fixture_writer(a, b, c).serialize();
  const std::string f32x2 = le_bytes<float>({1.0f, 2.0f});
  int k = 0;
  auto file = [&](std::string_view bytes) {
    return dir.write("bad" + std::to_string(k++) + ".safetensors", bytes);
  };
  auto header_file = [&](const std::string& header, std::string_view data) {
    return file(build_file(header, data));
  };

  expect_rejected(file(""), "too short");
  expect_rejected(file("abc"), "too short");
  expect_rejected(file(good.substr(0, 60)), "exceeds the 52 bytes");  // truncated inside the header
  expect_rejected(file(good.substr(0, good.size() - 4)),
                  "run past the data section");  // truncated data
  {
    std::string huge = good;
    uint64_t n = uint64_t{1} << 40;
    std::memcpy(huge.data(), &n, 8);
    expect_rejected(file(huge), "exceeds the limit");
    n = good.size() - 7;  // one byte more than the file holds
    std::memcpy(huge.data(), &n, 8);
    expect_rejected(file(huge), "exceeds the");
  }
  expect_rejected(header_file(R"({"a": {"dtype": "F32")", ""), "not valid JSON");
  expect_rejected(header_file(R"([1, 2])", ""), "expected an object");
  expect_rejected(header_file("{\"a\xFF\": {}}", ""), "not valid JSON");  // not UTF-8
  expect_rejected(header_file(R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", f32x2),
                  "unknown dtype \"F33\"");
  expect_rejected(header_file(R"({"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", "x"),
                  "unknown dtype");
  expect_rejected(header_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", f32x2), "\"dtype\"");
  expect_rejected(header_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", f32x2), "\"shape\"");
  expect_rejected(header_file(R"({"a":{"dtype":"F32","shape":[2]}})", f32x2), "data_offsets");
  expect_rejected(header_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", f32x2),
                  "data_offsets");
  expect_rejected(header_file(R"({"a":[1]})", f32x2), "tensor 'a'");
  expect_rejected(header_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32x2),
                  "not a non-negative integer");
  expect_rejected(header_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", f32x2),
                  "not a non-negative integer");
  expect_rejected(header_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}})", f32x2),
                  "not non-negative integers");
  expect_rejected(
      header_file(
          R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})",
          f32x2),
      "overflows");
  expect_rejected(header_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,100]}})", f32x2),
                  "run past the data section of 8 bytes");
  expect_rejected(header_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", f32x2),
                  "end before");
  expect_rejected(header_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f32x2),
                  "span 8 bytes, expected 12");
  const std::string f32x3 = le_bytes<float>({1, 2, 3});
  expect_rejected(header_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                              f32x3),
                  "overlap tensor 'a'");
  expect_rejected(header_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                              f32x3),
                  "data bytes [4, 8) before tensor 'b' belong to no tensor");
  expect_rejected(header_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f32x2),
                  "cover only 4");
  expect_rejected(header_file(R"({"__metadata__":{"k":1}})", ""), "expected a string");
  expect_rejected(header_file(R"({"__metadata__":[]})", ""), "__metadata__");

  // Valid edge cases: no tensors at all, and zero-size tensors sharing an offset.
  EXPECT_EQ(SafetensorsReader(header_file("{}", "")).size(), 0u);
  SafetensorsReader zs(header_file(R"({"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                                   R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                   R"("f":{"dtype":"U8","shape":[2,0],"data_offsets":[4,4]},)"
                                   R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                   f32x2));
  EXPECT_EQ(zs.names(), (std::vector<std::string>{"a", "e", "f", "b"}));
  EXPECT_EQ(zs.read_f32("b"), std::vector<float>{2.0f});
}

TEST(Safetensors, RandomCorruptionLoadsOrThrows) {
  TempDir dir("st");
  std::vector<float> w(40);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.1f;
  std::vector<bf16> h(6, bf16(0.5f));
  const int32_t ids[] = {3, 1, 4, 1, 5};
  SafetensorsWriter wr;
  wr.add("layers.0.w", SafetensorsDType::F32, {8, 5}, w.data());
  wr.add("layers.0.h", SafetensorsDType::BF16, {2, 3}, h.data());
  wr.add("ids", SafetensorsDType::I32, {5}, ids);
  wr.set_metadata("format", "pt");
  const std::string good = wr.serialize();
  const std::size_t header_end = 8 + wr.header().size();

  Rng rng(2024, rng_stream(RngPurpose::Test, 0, 0));
  uint64_t draw = 0;
  auto below = [&](uint64_t n) { return rng.below(draw++, n); };
  const std::string json_chars = "{}[]\",:0123456789-eE. ";
  int loaded = 0, rejected = 0;
  for (int iter = 0; iter < 200; ++iter) {
    std::string bytes = good;
    switch (below(6)) {
      case 0:  // flip bits in the length field or header
        for (uint64_t f = 1 + below(3); f > 0; --f)
          bytes[below(header_end)] ^= static_cast<char>(1u << below(8));
        break;
      case 1:  // flip a bit anywhere
        bytes[below(bytes.size())] ^= static_cast<char>(1u << below(8));
        break;
      case 2:  // truncate
        bytes.resize(below(bytes.size()));
        break;
      case 3:  // a JSON-significant character somewhere in the header
        bytes[8 + below(header_end - 8)] = json_chars[below(json_chars.size())];
        break;
      case 4: {  // random length field
        uint64_t n = below(bytes.size() + 16);
        std::memcpy(bytes.data(), &n, 8);
        break;
      }
      default:  // trailing garbage
        for (uint64_t e = 1 + below(16); e > 0; --e) bytes.push_back(static_cast<char>(below(256)));
        break;
    }
    auto path = dir.write("fuzz.safetensors", bytes);
    try {
      SafetensorsReader r(path);
      // A file that loads must be fully readable within its bounds.
      for (const auto& name : r.names()) {
        auto b = r.bytes(name);
        volatile uint8_t sink = 0;
        for (uint8_t x : b) sink = sink ^ x;
        if (r.dtype(name) == SafetensorsDType::F32 || r.dtype(name) == SafetensorsDType::BF16)
          r.read_f32(name, true);
      }
      ++loaded;
    } catch (const Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << iter << ": non-moetrain exception " << e.what();
    }
  }
  EXPECT_GT(loaded, 0);
  EXPECT_GT(rejected, 0);
  std::cout << "random corruption: " << loaded << " loaded, " << rejected << " rejected\n";
}
