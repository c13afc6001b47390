#include "data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "core/check.h"
#include "io/file.h"

namespace moetrain {

namespace {

// Payloads are read in pieces so that a lying header (billions of images) fails on the short
// payload instead of allocating what it claims.
constexpr std::size_t kReadPiece = std::size_t{1} << 20;
constexpr uint64_t kMaxIdxBytes = uint64_t{1} << 34;

// The decompressed bytes of a gzip file (one or more members) or of a plain file. Inflate is
// driven directly rather than through gzread: gzread reports a stream whose trailer was cut off as
// a clean end of file once the payload happens to fill the caller's buffer, and a damaged file must
// never pass as a complete one.
class IdxSource {
 public:
  explicit IdxSource(const std::filesystem::path& path) : name_(path.string()) {
    MOETRAIN_CHECK(std::filesystem::is_regular_file(path),
                   "IDX file '{}' does not exist or is not a regular file", name_);
    file_ = MappedFile(path);
    gzip_ = file_.size() >= 2 && file_.data()[0] == 0x1f && file_.data()[1] == 0x8b;
    if (gzip_) {
      int rc = inflateInit2(&zs_, 15 + 16);  // gzip wrapper only
      MOETRAIN_CHECK(rc == Z_OK, "IDX file '{}': cannot start zlib ({})", name_, rc);
      zs_.next_in = nullptr;
      zs_.avail_in = 0;
    }
  }
  ~IdxSource() {
    if (gzip_) inflateEnd(&zs_);
  }
  IdxSource(const IdxSource&) = delete;
  IdxSource& operator=(const IdxSource&) = delete;

  // Up to n bytes; fewer only at the end of the data. A damaged or truncated stream throws.
  std::size_t read(void* out, std::size_t n) {
    auto* dst = static_cast<uint8_t*>(out);
    if (!gzip_) {
      const std::size_t got = std::min(n, file_.size() - offset_);
      if (got > 0) std::memcpy(dst, file_.data() + offset_, got);
      offset_ += got;
      return got;
    }
    std::size_t got = 0;
    while (got < n && !ended_) {
      if (zs_.avail_in == 0 && offset_ < file_.size()) {
        const std::size_t piece = std::min(file_.size() - offset_, kReadPiece);
        zs_.next_in = const_cast<Bytef*>(file_.data() + offset_);
        zs_.avail_in = static_cast<uInt>(piece);
        offset_ += piece;
      }
      const std::size_t want = std::min(n - got, kReadPiece);
      zs_.next_out = dst + got;
      zs_.avail_out = static_cast<uInt>(want);
      const int rc = inflate(&zs_, Z_NO_FLUSH);
      got += want - zs_.avail_out;
      const std::size_t input_left = zs_.avail_in + (file_.size() - offset_);
      if (rc == Z_STREAM_END) {
        if (input_left == 0) {
          ended_ = true;
        } else {
          // Concatenated gzip members are one stream (gzip(1) semantics); anything else is garbage.
          const uint8_t* next = zs_.avail_in ? zs_.next_in : file_.data() + offset_;
          MOETRAIN_CHECK(input_left >= 2 && next[0] == 0x1f && next[1] == 0x8b,
                         "IDX file '{}': {} bytes of garbage after the gzip stream", name_,
                         input_left);
          inflateReset(&zs_);
        }
      } else if (rc == Z_BUF_ERROR && input_left == 0) {
        MOETRAIN_FAIL("IDX file '{}': gzip stream is truncated", name_);
      } else {
        MOETRAIN_CHECK(rc == Z_OK || rc == Z_BUF_ERROR,
                       "IDX file '{}': gzip stream is damaged ({})", name_,
                       zs_.msg ? zs_.msg : "zlib error " + std::to_string(rc));
      }
    }
    return got;
  }

 private:
  std::string name_;
  MappedFile file_;
  bool gzip_ = false;
  bool ended_ = false;
  std::size_t offset_ = 0;  // input consumed from the file (handed to zlib when gzip_)
  z_stream zs_{};
};

uint32_t big_endian_u32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}

}  // namespace

IdxArray read_idx(const std::filesystem::path& path, int ndim) {
  MOETRAIN_CHECK(ndim >= 1 && ndim <= 8, "read_idx: ndim {} outside [1, 8]", ndim);
  const std::string name = path.string();
  IdxSource f(path);
  uint8_t head[4 + 4 * 8];
  const std::size_t head_bytes = 4 + 4 * static_cast<std::size_t>(ndim);
  const std::size_t got_head = f.read(head, head_bytes);
  MOETRAIN_CHECK(got_head == head_bytes, "IDX file '{}': {} bytes, shorter than the {}-byte header",
                 name, got_head, head_bytes);
  const uint32_t magic = big_endian_u32(head);
  const uint32_t expected_magic = 0x00000800u | static_cast<uint32_t>(ndim);
  MOETRAIN_CHECK(magic == expected_magic,
                 "IDX file '{}': magic 0x{:08x}, expected 0x{:08x} (unsigned bytes, {} dims)", name,
                 magic, expected_magic, ndim);
  IdxArray a;
  uint64_t total = 1;
  for (int d = 0; d < ndim; ++d) {
    a.dims.push_back(big_endian_u32(head + 4 + 4 * d));
    total *= a.dims.back();
    MOETRAIN_CHECK(total <= kMaxIdxBytes, "IDX file '{}': dimensions {} exceed {} bytes", name,
                   fmt::join(a.dims, " x "), kMaxIdxBytes);
  }
  a.data.reserve(static_cast<std::size_t>(std::min<uint64_t>(total, 64 * kReadPiece)));
  while (a.data.size() < total) {
    const std::size_t want =
        static_cast<std::size_t>(std::min<uint64_t>(total - a.data.size(), kReadPiece));
    const std::size_t at = a.data.size();
    a.data.resize(at + want);
    const std::size_t got = f.read(a.data.data() + at, want);
    MOETRAIN_CHECK(got == want, "IDX file '{}': payload has {} bytes, dimensions {} need {}", name,
                   at + got, fmt::join(a.dims, " x "), total);
  }
  uint8_t extra;
  MOETRAIN_CHECK(f.read(&extra, 1) == 0,
                 "IDX file '{}': trailing bytes after the {}-byte payload ({})", name, total,
                 fmt::join(a.dims, " x "));
  return a;
}

ImageDataset load_idx_dataset(const std::filesystem::path& images,
                              const std::filesystem::path& labels, int32_t num_classes) {
  MOETRAIN_CHECK(num_classes >= 1 && num_classes <= 256,
                 "load_idx_dataset: num_classes {} outside [1, 256]", num_classes);
  IdxArray img = read_idx(images, 3);
  IdxArray lab = read_idx(labels, 1);
  MOETRAIN_CHECK(img.dims[0] == lab.dims[0],
                 "IDX files '{}' ({} images) and '{}' ({} labels) disagree on the count",
                 images.string(), img.dims[0], labels.string(), lab.dims[0]);
  ImageDataset ds;
  ds.n = img.dims[0];
  ds.rows = img.dims[1];
  ds.cols = img.dims[2];
  ds.num_classes = num_classes;
  ds.labels.resize(static_cast<std::size_t>(ds.n));
  for (int64_t i = 0; i < ds.n; ++i) {
    MOETRAIN_CHECK(lab.data[i] < num_classes,
                   "IDX file '{}': label {} of example {} is not below {} classes", labels.string(),
                   lab.data[i], i, num_classes);
    ds.labels[i] = lab.data[i];
  }
  ds.images.resize(img.data.size());
  for (std::size_t i = 0; i < img.data.size(); ++i)
    ds.images[i] = static_cast<float>(img.data[i]) / 255.0f;
  return ds;
}

ImageDataset load_fashion_mnist(std::string_view split, const std::filesystem::path& dir) {
  MOETRAIN_CHECK(split == "train" || split == "t10k",
                 "Fashion-MNIST split '{}' unknown (expected train or t10k)", split);
  const std::string s(split);
  return load_idx_dataset(dir / (s + "-images-idx3-ubyte.gz"), dir / (s + "-labels-idx1-ubyte.gz"),
                          10);
}

}  // namespace moetrain
