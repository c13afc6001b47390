// Rows of an image data set, as their own data set: what one process of a data-parallel test,
// or a small training set, reads.
#pragma once
#include <cstdint>
#include <memory>

#include "data/idx.h"

namespace moetrain::testing {

// Rows [begin, begin + n) of d.
inline std::shared_ptr<const ImageDataset> image_rows(const ImageDataset& d, int64_t begin,
                                                      int64_t n) {
  auto out = std::make_shared<ImageDataset>();
  const int64_t D = d.rows * d.cols;
  out->n = n, out->rows = d.rows, out->cols = d.cols, out->num_classes = d.num_classes;
  out->images.assign(d.images.begin() + begin * D, d.images.begin() + (begin + n) * D);
  out->labels.assign(d.labels.begin() + begin, d.labels.begin() + begin + n);
  return out;
}

}  // namespace moetrain::testing
