// The IDX format of (Fashion-)MNIST, gzip-compressed: a big-endian magic 0x000008DD (type 0x08 =
// unsigned byte, DD = number of dimensions), DD big-endian uint32 sizes, then the bytes.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string_view>
#include <vector>

namespace moetrain {

constexpr char kFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";

struct IdxArray {
  std::vector<uint32_t> dims;
  std::vector<uint8_t> data;  // (dims[0], dims[1], ...) row-major
};

// Reads a gzip (or plain) IDX file of unsigned bytes with `ndim` dimensions. Throws Error naming
// the file for a bad magic, a size that disagrees with the payload (short or trailing bytes), or a
// damaged gzip stream (truncated, CRC mismatch).
IdxArray read_idx(const std::filesystem::path& path, int ndim);

struct ImageDataset {
  int64_t n = 0;
  int64_t rows = 0, cols = 0;
  int32_t num_classes = 0;
  std::vector<float> images;    // (n, rows·cols), pixels / 255 in [0, 1]
  std::vector<int32_t> labels;  // (n), each in [0, num_classes)
};

// An idx3 image file and its idx1 label file: counts must match, labels must be < num_classes.
ImageDataset load_idx_dataset(const std::filesystem::path& images,
                              const std::filesystem::path& labels, int32_t num_classes);
// split: "train" (60000 images) or "t10k" (10000), from `dir` (the Debian dataset-fashion-mnist
// layout).
ImageDataset load_fashion_mnist(std::string_view split,
                                const std::filesystem::path& dir = kFashionMnistDir);

}  // namespace moetrain
