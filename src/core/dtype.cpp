#include "core/dtype.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/bf16_round.h"
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

MOETRAIN_BF16_TARGET void round_to_bf16_avx512(bf16* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store_bf16x16(out + i, _mm512_loadu_ps(in + i));
  for (; i < n; ++i) out[i] = bf16(in[i]);
}
}  // namespace

void round_to_bf16(bf16* out, const float* in, int64_t n) {
  if (cpu_has_avx512_bf16()) return round_to_bf16_avx512(out, in, n);
  for (int64_t i = 0; i < n; ++i) out[i] = bf16(in[i]);
}

void f32_to_bf16(bf16* out, const float* in, std::size_t n) {
  PhaseScope phase_scope(Phase::Convert);
  // Chunks of whole 16-lane vectors: the cut changes no element's result.
  constexpr std::ptrdiff_t kChunk = 1 << 14;
  const std::ptrdiff_t sn = static_cast<std::ptrdiff_t>(n);
  const std::ptrdiff_t chunks = (sn + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (sn > (1 << 16))
  for (std::ptrdiff_t c = 0; c < chunks; ++c)
    round_to_bf16(out + c * kChunk, in + c * kChunk, std::min(kChunk, sn - c * kChunk));
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
