// The Hugging Face safetensors format: an 8-byte little-endian header length N, N bytes of JSON
// ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}}),
// then the raw little-endian tensor bytes, offsets relative to the end of the header.
//
// The reader validates the whole header against the file before any tensor byte is touched, so a
// corrupt or hostile file ends in a moetrain::Error naming the file and the tensor, never in a
// read out of bounds. The writer is atomic: `path.tmp`, fsync, rename, fsync of the directory.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "io/file.h"

namespace moetrain {

// ---------------------------------------------------------------------------------------------
// Element types (the names are the format's own)

enum class SafetensorsDType {
  BOOL,
  U8,
  I8,
  F8_E5M2,
  F8_E4M3,
  I16,
  U16,
  F16,
  BF16,
  I32,
  U32,
  F32,
  F64,
  I64,
  U64
};

std::string_view safetensors_dtype_name(SafetensorsDType t);
std::size_t safetensors_dtype_size(SafetensorsDType t);
// nullopt for a name the format does not define (or one we do not handle, e.g. sub-byte types).
std::optional<SafetensorsDType> safetensors_dtype_from_name(std::string_view name);
SafetensorsDType to_safetensors_dtype(DType t);

// Weights read from `file` must be finite: a NaN or an infinity would load silently and surface
// steps later as a diverged loss. Throws naming the file, the tensor, the first bad element and
// how many there are. v holds elements [offset, offset + n) of the tensor.
void check_finite_tensor(const float* v, int64_t n, const std::filesystem::path& file,
                         const std::string& name, int64_t offset = 0);

// The header may not exceed this (the reference implementation's limit): a length field is read
// before anything is trusted, and a garbage one must not make us allocate gigabytes.
constexpr uint64_t kSafetensorsMaxHeader = 100'000'000;

// ---------------------------------------------------------------------------------------------
// Writer

class SafetensorsWriter {
 public:
  // Non-owning: `data` (numel(shape) * dtype size bytes) must stay valid until write().
  void add(std::string name, SafetensorsDType dtype, Shape shape, const void* data);
  // Owning: keeps `bytes`, which must hold exactly numel(shape) * dtype size bytes.
  void add_bytes(std::string name, SafetensorsDType dtype, Shape shape, std::vector<uint8_t> bytes);
  // Non-owning view of an f32 / bf16 tensor (kept alive by the caller until write()).
  void add(std::string name, const Tensor& t);
  // A tensor in the header only: the caller writes its bytes after header() itself (a tensor
  // streamed from outside memory); serialize() and write() refuse it.
  void add_streamed(std::string name, SafetensorsDType dtype, Shape shape);
  void set_metadata(std::string key, std::string value);

  std::size_t num_tensors() const { return entries_.size(); }
  // The JSON header, space-padded so that 8 + its length is a multiple of 8.
  std::string header() const;
  // The whole file image (tests and small files; write() streams instead).
  std::string serialize() const;
  // Tensors laid out in insertion order; atomic (see AtomicFileWriter).
  void write(const std::filesystem::path& path) const;

 private:
  struct Entry {
    std::string name;
    SafetensorsDType dtype;
    Shape shape;
    const void* data;
    std::size_t nbytes;
    std::vector<uint8_t> owned;
    bool streamed = false;
  };
  void add_entry(Entry e);

  std::vector<Entry> entries_;
  std::unordered_map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// ---------------------------------------------------------------------------------------------
// Reader

struct SafetensorsEntry {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::F32;
  Shape shape;
  uint64_t begin = 0;  // data_offsets, relative to the start of the data section
  uint64_t end = 0;
  int64_t numel() const { return shape_numel(shape); }
  uint64_t nbytes() const { return end - begin; }
};

class SafetensorsReader {
 public:
  // Maps the file and validates its header; throws Error naming the file on any inconsistency.
  explicit SafetensorsReader(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return file_.path(); }
  // Names in data order (ascending offsets).
  std::vector<std::string> names() const;
  std::size_t size() const { return entries_.size(); }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  // Throws if the tensor is absent.
  const SafetensorsEntry& entry(const std::string& name) const;
  SafetensorsDType dtype(const std::string& name) const { return entry(name).dtype; }
  const Shape& shape(const std::string& name) const { return entry(name).shape; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The tensor's bytes inside the map (no alignment guarantee: copy, don't cast).
  std::span<const uint8_t> bytes(const std::string& name) const;
  // Hands the whole pages of bytes already copied out of bytes() back (MappedFile::hand_back).
  void hand_back(std::span<const uint8_t> read) const { file_.hand_back(read.data(), read.size()); }
  // Copies exactly `nbytes` raw bytes (which must be the tensor's size) into `out`.
  void copy_bytes(const std::string& name, void* out, std::size_t nbytes) const;
  // Copies into `out` (n = numel floats). F32 copies; BF16 is widened only when convert_bf16 is
  // set, so that a precision change is never silent; any other dtype is an error.
  void copy_to_f32(const std::string& name, float* out, int64_t n, bool convert_bf16 = false) const;
  std::vector<float> read_f32(const std::string& name, bool convert_bf16 = false) const;
  // An owning Tensor with the file's shape and dtype (F32 or BF16 only).
  Tensor load_tensor(const std::string& name) const;

 private:
  void parse_header();

  MappedFile file_;
  uint64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;  // ascending offsets
  std::unordered_map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moetrain
