// The file primitives every format shares: a read-only memory map, and an atomic writer that
// leaves either the old file or the complete new one, never a torn one.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string_view>

namespace moetrain {

// A read-only memory map of a whole file. An empty file maps to an empty span.
class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  const std::filesystem::path& path() const { return path_; }
  // Hands the whole pages inside bytes [from, from + n) of the map, already read, back: they leave
  // this process's resident set, and a later read maps them again from the page cache or disk.
  void hand_back(const uint8_t* from, std::size_t n) const;

 private:
  void release();

  std::filesystem::path path_;
  const uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
  bool mapped_ = false;
};

// Writes `path.tmp`; commit() fsyncs it, renames it onto `path` and fsyncs the directory, so a
// crash leaves either the old file or the complete new one under `path`, never a torn one.
// Destroyed without commit() (an error on the way), it removes the temporary.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::filesystem::path path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, std::size_t n);
  void commit();
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::filesystem::path tmp_;
  int fd_ = -1;
};

// Appends `bytes` to the end of the file open as `fd` (`path` names it in errors) whole or not at
// all: a short or failed write (a full disk, a file-size limit) is cut back off before the error
// is thrown, so a line or a record is never left half-written.
void append_whole(int fd, const std::filesystem::path& path, std::string_view bytes);

// Writes `bytes` to `path` through an AtomicFileWriter.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

}  // namespace moetrain
