// bf16(float) over 16 lanes at once with AVX512_BF16's vcvtneps2bf16, for code built for that
// instruction set (MOETRAIN_BF16_TARGET) on CPUs that have it (cpu_has_avx512_bf16()).
//
// The instruction rounds to nearest even and quiets a NaN by setting the same bit as
// bf16::round_bits (core/dtype.h), so normal numbers, zeros, infinities and NaNs get the same
// bits as the scalar rule. It flushes subnormal inputs to zero, which the scalar rule does not:
// a vector holding a subnormal lane (vfpclassps) takes the scalar rule lane by lane instead.
// Results are therefore the same bits on every CPU; only the speed differs (docs/PERF.md).
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "core/cpu.h"  // cpu_has_avx512_bf16
#include "core/dtype.h"

namespace moetrain {

// AVX512_BF16 comes with AVX512F/BW/VL/DQ on every CPU that has it (Cooper Lake, Sapphire Rapids,
// Zen 4).
#define MOETRAIN_BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))


// vfpclassps's category of a denormal (subnormal) lane.
constexpr int kFpclassSubnormal = 0x20;

// p[0..16) = the instruction's rounding of v: bf16(v[k]) for every lane that is not subnormal.
MOETRAIN_BF16_TARGET [[gnu::always_inline]] inline void store_bf16x16_cvt(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// p[0..16) = bf16(v[k]) for each lane k.
MOETRAIN_BF16_TARGET [[gnu::always_inline]] inline void store_bf16x16(bf16* p, __m512 v) {
  if (_mm512_fpclass_ps_mask(v, kFpclassSubnormal)) [[unlikely]] {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, v);
    for (int k = 0; k < 16; ++k) p[k] = bf16(lanes[k]);
    return;
  }
  store_bf16x16_cvt(p, v);
}

// The same store for a loop that stores a whole range before it looks: the instruction alone
// rounds, and the lanes' subnormal flags are or-ed into `seen`; where `seen` ends non-zero the
// caller stores the range again by the scalar rule. A subnormal is rare in the ranges this
// serves, and one test a range costs less than a test and branch a vector.
MOETRAIN_BF16_TARGET [[gnu::always_inline]] inline void store_bf16x16_flagged(bf16* p, __m512 v,
                                                                             unsigned& seen) {
  seen |= _mm512_fpclass_ps_mask(v, kFpclassSubnormal);
  store_bf16x16_cvt(p, v);
}

}  // namespace moetrain
