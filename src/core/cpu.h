// What this CPU can run, asked once per feature: the kernels' wide paths (AVX2, AVX-512,
// AVX512_BF16) are picked at run time, on x86-64 built with GCC; elsewhere every answer is false.
#pragma once

namespace moetrain {

#if defined(__x86_64__) && defined(__GNUC__)
#define MOETRAIN_CPU_FEATURE(name, feature)                \
  inline bool name() {                                     \
    static const bool has = __builtin_cpu_supports(feature); \
    return has;                                            \
  }
#else
#define MOETRAIN_CPU_FEATURE(name, feature) \
  inline bool name() { return false; }
#endif

MOETRAIN_CPU_FEATURE(cpu_has_avx2, "avx2")
MOETRAIN_CPU_FEATURE(cpu_has_avx512f, "avx512f")
MOETRAIN_CPU_FEATURE(cpu_has_avx512_bf16, "avx512bf16")
#undef MOETRAIN_CPU_FEATURE

}  // namespace moetrain
