// train.precision = "auto": the GEMM precision a run uses, from what this CPU computes natively.
#pragma once
#include <string>

namespace moetrain {

// The instruction set oneDNN dispatches to on this machine ("avx2", "avx512_core_bf16", ...).
std::string onednn_cpu_isa();

// True where oneDNN has a native bf16 matmul on `cpu_isa`: AVX512_BF16 or AMX. Elsewhere it
// widens bf16 operands to f32, which costs the conversions and gains nothing.
bool has_native_bf16(const std::string& cpu_isa);

// "auto" → "bf16" where has_native_bf16(cpu_isa), else "f32"; any other value unchanged.
std::string resolve_precision(const std::string& precision, const std::string& cpu_isa);

}  // namespace moetrain
