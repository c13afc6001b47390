#include "core/dtype.h"

#include <cstring>
#include <string>

#include "core/check.h"
#include "core/profile.h"
#include "core/tensor.h"

namespace moetrain {

DType parse_dtype(std::string_view name, std::string_view key,
                  std::initializer_list<DType> allowed) {
  std::string names;
  for (DType t : allowed) {
    if (name == dtype_name(t)) return t;
    if (!names.empty()) names += ", ";
    names += dtype_name(t);
  }
  MOETRAIN_FAIL("{} = '{}': allowed are {}", key, name, names);
}

namespace {
template <class To, class From, class Fn>
void convert(To* out, const From* in, std::size_t n, Fn fn) {
  PhaseScope phase_scope(Phase::Convert);
  const std::ptrdiff_t sn = static_cast<std::ptrdiff_t>(n);
#pragma omp parallel for schedule(static) if (sn > (1 << 16))
  for (std::ptrdiff_t i = 0; i < sn; ++i) out[i] = fn(in[i]);
}
}  // namespace

void f32_to_bf16(bf16* out, const float* in, std::size_t n) {
  convert(out, in, n, [](float f) { return bf16(f); });
}
void bf16_to_f32(float* out, const bf16* in, std::size_t n) {
  convert(out, in, n, [](bf16 h) { return h.to_float(); });
}
void f32_to_fp16(fp16* out, const float* in, std::size_t n) {
  convert(out, in, n, [](float f) { return fp16(f); });
}
void fp16_to_f32(float* out, const fp16* in, std::size_t n) {
  convert(out, in, n, [](fp16 h) { return h.to_float(); });
}

void f32_to_dtype(DType t, void* out, const float* in, std::size_t n) {
  switch (t) {
    case DType::BF16:
      return f32_to_bf16(static_cast<bf16*>(out), in, n);
    case DType::F16:
      return f32_to_fp16(static_cast<fp16*>(out), in, n);
    case DType::F32:
      if (n > 0) std::memcpy(out, in, n * sizeof(float));
      return;
  }
}

void dtype_to_f32(DType t, float* out, const void* in, std::size_t n) {
  switch (t) {
    case DType::BF16:
      return bf16_to_f32(out, static_cast<const bf16*>(in), n);
    case DType::F16:
      return fp16_to_f32(out, static_cast<const fp16*>(in), n);
    case DType::F32:
      if (n > 0) std::memcpy(out, in, n * sizeof(float));
      return;
  }
}

}  // namespace moetrain
