// Grow-only, 64-byte aligned scratch for a layer's activations: resizing it every forward costs
// nothing once the largest batch has been seen, and nothing is zero-filled.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "core/tensor.h"

namespace moetrain {

// n elements of `ElemBytes` bytes each, at least; the contents are unspecified after growth.
// A growth takes at least twice the capacity: sizes that creep upward step after step (the rows
// an expert-parallel rank receives, as the routing reaches new peaks) reallocate, and fault in
// fresh pages, a few times rather than at every new peak. Pages never touched cost no memory.
template <std::size_t ElemBytes>
class GrowBuffer {
 public:
  void* grow(int64_t n) {
    if (n > capacity_) {
      const int64_t c = capacity_ == 0 ? n : std::max(n, capacity_ * 2);
      data_.reset(aligned_alloc64(static_cast<std::size_t>(c) * ElemBytes));
      capacity_ = c;
    }
    return data_.get();
  }
  void* raw() const { return data_.get(); }
  // Gives the memory back; the next grow allocates afresh.
  void release() {
    data_.reset();
    capacity_ = 0;
  }
  int64_t bytes() const { return capacity_ * static_cast<int64_t>(ElemBytes); }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<void, Free> data_;
  int64_t capacity_ = 0;
};

// f32 activations.
class FloatBuffer {
 public:
  float* ensure(int64_t n) { return static_cast<float*>(buf_.grow(n)); }
  float* data() const { return static_cast<float*>(buf_.raw()); }
  void release() { buf_.release(); }
  int64_t bytes() const { return buf_.bytes(); }

 private:
  GrowBuffer<sizeof(float)> buf_;
};

// 16-bit elements (bf16 or fp16, chosen by its user).
class HalfBuffer {
 public:
  void* ensure(int64_t n) { return buf_.grow(n); }
  void* data() const { return buf_.raw(); }
  void release() { buf_.release(); }
  int64_t bytes() const { return buf_.bytes(); }
  template <class T>
  T* as() const {
    static_assert(sizeof(T) == 2);
    return static_cast<T*>(buf_.raw());
  }

 private:
  GrowBuffer<2> buf_;
};

}  // namespace moetrain
