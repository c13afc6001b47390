#include "core/tensor.h"

#include <cstdlib>
#include <cstring>

#include <sys/mman.h>

namespace moetrain {

std::string shape_str(const Shape& s) {
  std::string out = "(";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    MOETRAIN_CHECK(d >= 0, "negative dimension in shape {}", shape_str(s));
    n *= d;
  }
  return n;
}

void* aligned_alloc64(std::size_t bytes) {
  std::size_t rounded = (bytes + 63) / 64 * 64;
  if (rounded == 0) rounded = 64;
  // Blocks of a huge page or more start on one and ask for transparent huge pages (Linux's
  // default leaves them to madvise): the optimizer's streams and the layers' activations then
  // miss the TLB a 512th as often.
  constexpr std::size_t kHuge = std::size_t{2} << 20;
  const bool huge = rounded >= kHuge;
  if (huge) rounded = (rounded + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(huge ? kHuge : 64, rounded);
  MOETRAIN_CHECK(p != nullptr, "out of memory allocating {} bytes", bytes);
#ifdef MADV_HUGEPAGE
  if (huge) ::madvise(p, rounded, MADV_HUGEPAGE);  // advice only: no huge pages is no error
#endif
  return p;
}

Tensor::Tensor(Shape shape, DType dtype) : shape_(std::move(shape)), dtype_(dtype) {
  numel_ = shape_numel(shape_);
  std::size_t bytes = nbytes();
  void* p = aligned_alloc64(bytes);
  std::memset(p, 0, (bytes + 63) / 64 * 64);
  storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  data_ = p;
}

Tensor Tensor::wrap(void* data, Shape shape, DType dtype) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.numel_ = shape_numel(t.shape_);
  t.dtype_ = dtype;
  t.data_ = data;
  return t;
}

int64_t Tensor::dim(int i) const {
  int n = ndim();
  if (i < 0) i += n;
  MOETRAIN_CHECK(i >= 0 && i < n, "dimension {} out of range for tensor {}", i, shape_str(shape_));
  return shape_[i];
}

Tensor Tensor::view(Shape shape) const {
  int infer = -1;
  int64_t known = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      MOETRAIN_CHECK(infer < 0, "view {}: at most one -1", shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    MOETRAIN_CHECK(known > 0 && numel_ % known == 0, "cannot view {} as {}", shape_str(shape_),
                   shape_str(shape));
    shape[infer] = numel_ / known;
  }
  MOETRAIN_CHECK(shape_numel(shape) == numel_, "cannot view {} ({} elements) as {}",
                 shape_str(shape_), numel_, shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  MOETRAIN_CHECK(ndim() >= 1, "slice of a scalar tensor");
  MOETRAIN_CHECK(0 <= begin && begin <= end && end <= shape_[0],
                 "slice [{}, {}) out of range for {}", begin, end, shape_str(shape_));
  int64_t row = shape_[0] == 0 ? 0 : numel_ / shape_[0];
  Tensor t = *this;
  t.shape_[0] = end - begin;
  t.numel_ = row * (end - begin);
  t.data_ = static_cast<char*>(data_) + static_cast<std::size_t>(begin * row) * dtype_size(dtype_);
  return t;
}

Tensor Tensor::operator[](int64_t i) const {
  Tensor t = slice(i, i + 1);
  t.shape_.erase(t.shape_.begin());
  return t;
}

Tensor Tensor::clone() const {
  Tensor t(shape_, dtype_);
  if (numel_) std::memcpy(t.data_, data_, nbytes());
  return t;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return clone();
  Tensor t(shape_, dtype);
  if (dtype_ == DType::F32) {
    f32_to_dtype(dtype, t.raw(), f32(), numel_);
  } else if (dtype == DType::F32) {
    dtype_to_f32(dtype_, t.f32(), raw(), numel_);
  } else {
    return to(DType::F32).to(dtype);
  }
  return t;
}

void Tensor::zero() {
  if (numel_) std::memset(data_, 0, nbytes());
}

void Tensor::fill(float value) {
  if (dtype_ == DType::F32) {
    float* p = f32();
    for (int64_t i = 0; i < numel_; ++i) p[i] = value;
  } else if (dtype_ == DType::BF16) {
    bf16* p = bf();
    bf16 v(value);
    for (int64_t i = 0; i < numel_; ++i) p[i] = v;
  } else {
    fp16* p = static_cast<fp16*>(data_);
    fp16 v(value);
    for (int64_t i = 0; i < numel_; ++i) p[i] = v;
  }
}

void Tensor::copy_from(const Tensor& other) {
  MOETRAIN_CHECK(other.shape_ == shape_ && other.dtype_ == dtype_, "copy_from: {} {} into {} {}",
                 shape_str(other.shape_), dtype_name(other.dtype_), shape_str(shape_),
                 dtype_name(dtype_));
  if (numel_) std::memcpy(data_, other.data_, nbytes());
}

}  // namespace moetrain
