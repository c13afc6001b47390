#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <tuple>
#include <utility>

#include "core/check.h"

namespace moetrain {

static_assert(std::endian::native == std::endian::little,
              "safetensors data and length fields are little-endian; this build assumes a "
              "little-endian host");

// ---------------------------------------------------------------------------------------------
// Dtypes

namespace {
struct DTypeInfo {
  SafetensorsDType type;
  std::string_view name;
  std::size_t size;
};
constexpr std::array<DTypeInfo, 15> kDTypes{{
    {SafetensorsDType::BOOL, "BOOL", 1},
    {SafetensorsDType::U8, "U8", 1},
    {SafetensorsDType::I8, "I8", 1},
    {SafetensorsDType::F8_E5M2, "F8_E5M2", 1},
    {SafetensorsDType::F8_E4M3, "F8_E4M3", 1},
    {SafetensorsDType::I16, "I16", 2},
    {SafetensorsDType::U16, "U16", 2},
    {SafetensorsDType::F16, "F16", 2},
    {SafetensorsDType::BF16, "BF16", 2},
    {SafetensorsDType::I32, "I32", 4},
    {SafetensorsDType::U32, "U32", 4},
    {SafetensorsDType::F32, "F32", 4},
    {SafetensorsDType::F64, "F64", 8},
    {SafetensorsDType::I64, "I64", 8},
    {SafetensorsDType::U64, "U64", 8},
}};
constexpr bool dtype_table_in_enum_order() {
  for (std::size_t i = 0; i < kDTypes.size(); ++i) {
    if (static_cast<std::size_t>(kDTypes[i].type) != i) return false;
  }
  return true;
}
static_assert(dtype_table_in_enum_order(), "kDTypes is indexed by SafetensorsDType");
const DTypeInfo& dtype_info(SafetensorsDType t) {
  return kDTypes[static_cast<std::size_t>(t)];
}

// numel * elem_size, or nullopt when a dimension is negative or the product overflows.
std::optional<uint64_t> checked_nbytes(const Shape& shape, std::size_t elem_size) {
  uint64_t n = elem_size;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return std::nullopt;
  }
  if (n > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
  return n;
}

std::string shape_json(const Shape& s) {
  return nlohmann::json(s).dump();
}
}  // namespace

std::string_view safetensors_dtype_name(SafetensorsDType t) {
  return dtype_info(t).name;
}
std::size_t safetensors_dtype_size(SafetensorsDType t) {
  return dtype_info(t).size;
}

std::optional<SafetensorsDType> safetensors_dtype_from_name(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (d.name == name) return d.type;
  }
  return std::nullopt;
}

SafetensorsDType to_safetensors_dtype(DType t) {
  return t == DType::F32 ? SafetensorsDType::F32 : SafetensorsDType::BF16;
}

// ---------------------------------------------------------------------------------------------
// Writer

void SafetensorsWriter::add_entry(Entry e) {
  MOETRAIN_CHECK(e.name != "__metadata__",
                 "safetensors: '__metadata__' is reserved and cannot name a tensor");
  MOETRAIN_CHECK(!index_.count(e.name), "safetensors: tensor '{}' added twice", e.name);
  auto nbytes = checked_nbytes(e.shape, safetensors_dtype_size(e.dtype));
  MOETRAIN_CHECK(nbytes.has_value(), "safetensors: tensor '{}' has an invalid shape {}", e.name,
                 shape_json(e.shape));
  MOETRAIN_CHECK(e.nbytes == *nbytes, "safetensors: tensor '{}' ({} {}) needs {} bytes, got {}",
                 e.name, safetensors_dtype_name(e.dtype), shape_json(e.shape), *nbytes, e.nbytes);
  MOETRAIN_CHECK(e.data != nullptr || e.nbytes == 0 || e.streamed,
                 "safetensors: tensor '{}' has null data", e.name);
  index_.emplace(e.name, entries_.size());
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::add(std::string name, SafetensorsDType dtype, Shape shape,
                            const void* data) {
  auto nbytes = checked_nbytes(shape, safetensors_dtype_size(dtype));
  MOETRAIN_CHECK(nbytes.has_value(), "safetensors: tensor '{}' has an invalid shape {}", name,
                 shape_json(shape));
  add_entry(
      Entry{std::move(name), dtype, std::move(shape), data, static_cast<std::size_t>(*nbytes), {}});
}

void SafetensorsWriter::add_streamed(std::string name, SafetensorsDType dtype, Shape shape) {
  auto nbytes = checked_nbytes(shape, safetensors_dtype_size(dtype));
  MOETRAIN_CHECK(nbytes.has_value(), "safetensors: tensor '{}' has an invalid shape {}", name,
                 shape_json(shape));
  add_entry(Entry{std::move(name), dtype, std::move(shape), nullptr,
                  static_cast<std::size_t>(*nbytes), {}, true});
}

void SafetensorsWriter::add_bytes(std::string name, SafetensorsDType dtype, Shape shape,
                                  std::vector<uint8_t> bytes) {
  Entry e{std::move(name), dtype, std::move(shape), nullptr, bytes.size(), std::move(bytes)};
  e.data = e.owned.data();
  add_entry(std::move(e));
}

void SafetensorsWriter::add(std::string name, const Tensor& t) {
  add(std::move(name), to_safetensors_dtype(t.dtype()), t.shape(), t.raw());
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

std::string SafetensorsWriter::header() const {
  // ordered_json keeps the reference layout: "__metadata__" first, then tensors in file order.
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) meta[k] = v;
    h["__metadata__"] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const auto& e : entries_) {
    nlohmann::ordered_json t = nlohmann::ordered_json::object();
    t["dtype"] = safetensors_dtype_name(e.dtype);
    t["shape"] = e.shape;
    t["data_offsets"] = {offset, offset + e.nbytes};
    offset += e.nbytes;
    h[e.name] = std::move(t);
  }
  std::string s = h.dump();
  // Spaces up to a multiple of 8 so the data section starts 8-aligned in the file.
  s.append((8 - s.size() % 8) % 8, ' ');
  return s;
}

std::string SafetensorsWriter::serialize() const {
  for (const auto& e : entries_)
    MOETRAIN_CHECK(!e.streamed, "safetensors: tensor '{}' is streamed by its caller", e.name);
  std::string h = header();
  std::string out(8, '\0');
  uint64_t n = h.size();
  std::memcpy(out.data(), &n, 8);
  out += h;
  for (const auto& e : entries_) out.append(static_cast<const char*>(e.data), e.nbytes);
  return out;
}

void SafetensorsWriter::write(const std::filesystem::path& path) const {
  for (const auto& e : entries_)
    MOETRAIN_CHECK(!e.streamed, "safetensors: tensor '{}' is streamed by its caller", e.name);
  std::string h = header();
  uint64_t n = h.size();
  AtomicFileWriter w(path);
  w.write(&n, 8);
  w.write(h.data(), h.size());
  for (const auto& e : entries_) w.write(e.data, e.nbytes);
  w.commit();
}

// ---------------------------------------------------------------------------------------------
// Reader

SafetensorsReader::SafetensorsReader(const std::filesystem::path& path) : file_(path) {
  parse_header();
}

void SafetensorsReader::parse_header() {
  const std::string file = file_.path().string();
  const uint64_t size = file_.size();
  MOETRAIN_CHECK(size >= 8,
                 "safetensors file '{}': {} bytes, too short for the 8-byte header length", file,
                 size);
  uint64_t n = 0;
  std::memcpy(&n, file_.data(), 8);
  MOETRAIN_CHECK(n <= kSafetensorsMaxHeader,
                 "safetensors file '{}': header length {} exceeds the limit of {} bytes", file, n,
                 kSafetensorsMaxHeader);
  MOETRAIN_CHECK(n <= size - 8,
                 "safetensors file '{}': header length {} exceeds the {} bytes that follow it",
                 file, n, size - 8);
  data_start_ = 8 + n;
  const uint64_t data_size = size - data_start_;

  nlohmann::json h;
  try {
    const char* begin = reinterpret_cast<const char*>(file_.data() + 8);
    h = nlohmann::json::parse(begin, begin + n);
  } catch (const nlohmann::json::exception& e) {
    MOETRAIN_FAIL("safetensors file '{}': header is not valid JSON: {}", file, e.what());
  }
  MOETRAIN_CHECK(h.is_object(), "safetensors file '{}': header is a JSON {}, expected an object",
                 file, h.type_name());

  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      MOETRAIN_CHECK(v.is_object(),
                     "safetensors file '{}': __metadata__ is a JSON {}, expected an object", file,
                     v.type_name());
      for (auto m = v.begin(); m != v.end(); ++m) {
        MOETRAIN_CHECK(
            m.value().is_string(),
            "safetensors file '{}': __metadata__ value '{}' is a JSON {}, expected a string", file,
            m.key(), m.value().type_name());
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = fmt::format("safetensors file '{}': tensor '{}'", file, name);
    MOETRAIN_CHECK(v.is_object(), "{}: entry is a JSON {}, expected an object", where,
                   v.type_name());
    MOETRAIN_CHECK(v.contains("dtype") && v["dtype"].is_string(),
                   "{}: missing or non-string \"dtype\"", where);
    MOETRAIN_CHECK(v.contains("shape") && v["shape"].is_array(),
                   "{}: missing or non-array \"shape\"", where);
    MOETRAIN_CHECK(
        v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
        "{}: \"data_offsets\" must be an array [begin, end]", where);

    SafetensorsEntry e;
    e.name = name;
    const std::string dtype_name = v["dtype"].get<std::string>();
    auto dtype = safetensors_dtype_from_name(dtype_name);
    MOETRAIN_CHECK(dtype.has_value(),
                   "{}: unknown dtype \"{}\" (expected one of BOOL, U8, I8, F8_E5M2, F8_E4M3, "
                   "I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64)",
                   where, dtype_name);
    e.dtype = *dtype;
    for (const auto& d : v["shape"]) {
      MOETRAIN_CHECK(
          d.is_number_unsigned() && d.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX),
          "{}: shape {} has an entry {} that is not a non-negative integer", where,
          v["shape"].dump(), d.dump());
      e.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
    }
    const auto& off = v["data_offsets"];
    MOETRAIN_CHECK(off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                   "{}: data_offsets {} are not non-negative integers", where, off.dump());
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    MOETRAIN_CHECK(e.begin <= e.end, "{}: data_offsets [{}, {}] end before they begin", where,
                   e.begin, e.end);
    MOETRAIN_CHECK(e.end <= data_size,
                   "{}: data_offsets [{}, {}] run past the data section of {} bytes", where,
                   e.begin, e.end, data_size);
    auto expected = checked_nbytes(e.shape, safetensors_dtype_size(e.dtype));
    MOETRAIN_CHECK(expected.has_value(), "{}: shape {} overflows", where, shape_json(e.shape));
    MOETRAIN_CHECK(e.end - e.begin == *expected,
                   "{}: data_offsets [{}, {}] span {} bytes, expected {} for {} {}", where, e.begin,
                   e.end, e.end - e.begin, *expected, dtype_name, shape_json(e.shape));
    entries_.push_back(std::move(e));
  }

  // The tensors must tile the data section exactly: no overlaps (two tensors aliasing bytes) and no
  // holes (bytes nobody owns, the sign of a truncated or spliced file).
  std::sort(entries_.begin(), entries_.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
            });
  uint64_t pos = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const auto& e : entries_) {
    MOETRAIN_CHECK(
        e.begin >= pos,
        "safetensors file '{}': tensor '{}' data_offsets [{}, {}] overlap tensor '{}' [{}, {}]",
        file, e.name, e.begin, e.end, prev ? prev->name : "", prev ? prev->begin : 0, pos);
    MOETRAIN_CHECK(
        e.begin == pos,
        "safetensors file '{}': data bytes [{}, {}) before tensor '{}' belong to no tensor", file,
        pos, e.begin, e.name);
    pos = e.end;
    prev = &e;
  }
  MOETRAIN_CHECK(pos == data_size,
                 "safetensors file '{}': data section is {} bytes but the tensors cover only {}",
                 file, data_size, pos);
  for (std::size_t i = 0; i < entries_.size(); ++i) index_.emplace(entries_[i].name, i);
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& e : entries_) out.push_back(e.name);
  return out;
}

const SafetensorsEntry& SafetensorsReader::entry(const std::string& name) const {
  auto it = index_.find(name);
  MOETRAIN_CHECK(it != index_.end(), "safetensors file '{}': no tensor named '{}' ({} tensors)",
                 path().string(), name, entries_.size());
  return entries_[it->second];
}

std::span<const uint8_t> SafetensorsReader::bytes(const std::string& name) const {
  const auto& e = entry(name);
  return {file_.data() + data_start_ + e.begin, static_cast<std::size_t>(e.nbytes())};
}

void SafetensorsReader::copy_bytes(const std::string& name, void* out, std::size_t nbytes) const {
  auto b = bytes(name);
  MOETRAIN_CHECK(nbytes == b.size(),
                 "safetensors file '{}': tensor '{}' has {} bytes, caller expects {}",
                 path().string(), name, b.size(), nbytes);
  if (!b.empty()) std::memcpy(out, b.data(), b.size());
}

void SafetensorsReader::copy_to_f32(const std::string& name, float* out, int64_t n,
                                    bool convert_bf16) const {
  const auto& e = entry(name);
  MOETRAIN_CHECK(n == e.numel(),
                 "safetensors file '{}': tensor '{}' {} has {} elements, caller expects {}",
                 path().string(), name, shape_json(e.shape), e.numel(), n);
  const uint8_t* src = file_.data() + data_start_ + e.begin;
  if (e.dtype == SafetensorsDType::F32) {
    if (n > 0) std::memcpy(out, src, static_cast<std::size_t>(n) * 4);
    return;
  }
  MOETRAIN_CHECK(e.dtype == SafetensorsDType::BF16 && convert_bf16,
                 "safetensors file '{}': tensor '{}' is {}, expected F32{}", path().string(), name,
                 safetensors_dtype_name(e.dtype),
                 e.dtype == SafetensorsDType::BF16 ? " (BF16 widening not requested)" : "");
  // The bytes may sit at an odd address (offsets follow the previous tensor), so go through memcpy.
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    out[i] = bf16::from_bits(bits).to_float();
  }
}

std::vector<float> SafetensorsReader::read_f32(const std::string& name, bool convert_bf16) const {
  std::vector<float> out(static_cast<std::size_t>(entry(name).numel()));
  copy_to_f32(name, out.data(), static_cast<int64_t>(out.size()), convert_bf16);
  return out;
}

Tensor SafetensorsReader::load_tensor(const std::string& name) const {
  const auto& e = entry(name);
  MOETRAIN_CHECK(e.dtype == SafetensorsDType::F32 || e.dtype == SafetensorsDType::BF16,
                 "safetensors file '{}': tensor '{}' is {}, a Tensor holds only F32 or BF16",
                 path().string(), name, safetensors_dtype_name(e.dtype));
  Tensor t(e.shape, e.dtype == SafetensorsDType::F32 ? DType::F32 : DType::BF16);
  copy_bytes(name, t.raw(), t.nbytes());
  return t;
}

void check_finite_tensor(const float* v, int64_t n, const std::filesystem::path& file,
                         const std::string& name, int64_t offset) {
  int64_t first = -1, bad = 0;
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i])) {
      if (first < 0) first = i;
      ++bad;
    }
  MOETRAIN_CHECK(bad == 0,
                 "{}: tensor '{}' holds {} non-finite value(s) (element {} is {}): the weights are "
                 "damaged or come from a run that diverged; load another checkpoint",
                 file.string(), name, bad, offset + first, first >= 0 ? v[first] : 0.0f);
}

}  // namespace moetrain
