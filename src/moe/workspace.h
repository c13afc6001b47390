// Grow-only, 64-byte aligned scratch for a layer's activations: resizing it every forward costs
// nothing once the largest batch has been seen, and nothing is zero-filled.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "core/tensor.h"

namespace moetrain {

class FloatBuffer {
 public:
  // At least n floats; the contents are unspecified after growth.
  float* ensure(int64_t n) {
    if (n > capacity_) {
      data_.reset(
          static_cast<float*>(aligned_alloc64(static_cast<std::size_t>(n) * sizeof(float))));
      capacity_ = n;
    }
    return data_.get();
  }
  float* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
  int64_t capacity_ = 0;
};

}  // namespace moetrain
