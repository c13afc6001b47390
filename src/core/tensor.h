// Tensor: a shape and a dtype over 64-byte aligned storage. Owning tensors allocate;
// views share the storage of their parent (contiguous row-major slices and reshapes).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"

namespace moetrain {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

class Tensor {
 public:
  Tensor() = default;
  // Zero-filled, 64-byte aligned.
  Tensor(Shape shape, DType dtype = DType::F32);
  static Tensor zeros(Shape shape, DType dtype = DType::F32) {
    return Tensor(std::move(shape), dtype);
  }
  // Non-owning wrapper over external memory (caller keeps it alive).
  static Tensor wrap(void* data, Shape shape, DType dtype = DType::F32);

  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return numel_; }
  DType dtype() const { return dtype_; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel_) * dtype_size(dtype_); }
  bool defined() const { return data_ != nullptr || numel_ == 0; }

  void* raw() const { return data_; }
  template <typename T>
  T* data() const {
    check_type<T>();
    return static_cast<T*>(data_);
  }
  float* f32() const { return data<float>(); }
  bf16* bf() const { return data<bf16>(); }

  // Same storage, new shape with the same number of elements (one dim may be -1).
  Tensor view(Shape shape) const;
  // Rows [begin, end) along dim 0, sharing storage.
  Tensor slice(int64_t begin, int64_t end) const;
  // Row i along dim 0 with that dim removed.
  Tensor operator[](int64_t i) const;

  Tensor clone() const;
  Tensor to(DType dtype) const;  // converting copy (f32 <-> bf16, rounding to nearest even)
  void zero();
  void fill(float value);
  void copy_from(const Tensor& other);  // same shape and dtype

 private:
  template <typename T>
  void check_type() const {
    if constexpr (std::is_same_v<T, float>) {
      MOETRAIN_CHECK(dtype_ == DType::F32, "tensor {} is {}, asked for f32", shape_str(shape_),
                     dtype_name(dtype_));
    } else if constexpr (std::is_same_v<T, bf16>) {
      MOETRAIN_CHECK(dtype_ == DType::BF16, "tensor {} is {}, asked for bf16", shape_str(shape_),
                     dtype_name(dtype_));
    }
  }

  std::shared_ptr<void> storage_;  // null for wrapped memory
  void* data_ = nullptr;
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::F32;
};

// 64-byte aligned allocation, freed with std::free. Used by Tensor and by flat parameter buffers.
void* aligned_alloc64(std::size_t bytes);

}  // namespace moetrain
