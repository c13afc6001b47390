// train.precision, parsed once into a typed value when the configuration loads: what the model's
// GEMMs take as operands on the CPU (gemm_dtype) and how a device runs its GEMMs (device_gemm).
// "auto" is resolved once, at load (TrainConfig::resolve_precision), to what this machine
// computes natively; a run records the value it resolved to and keeps it on resume.
#pragma once
#include <string>

#include "core/dtype.h"

namespace moetrain {

enum class Precision { Auto, F32, BF16, FP16, TF32 };

// "auto", "f32", "bf16", "fp16", "tf32"; anything else is an Error naming train.precision, the
// value and the allowed names.
Precision parse_precision(const std::string& name);
const char* precision_name(Precision p);

// The operand type of the model's GEMMs on the CPU: f32 (f32 and tf32, whose rounding only a
// GPU's tensor cores do), bf16 or fp16. Auto is an Error: it is resolved when the config loads.
DType gemm_dtype(Precision p);
// What a device's GEMMs compute in (train.device = cuda): f32, tf32 or bf16.
DeviceGemm device_gemm(Precision p);

// The instruction set oneDNN dispatches to on this machine ("avx2", "avx512_core_bf16", ...).
std::string onednn_cpu_isa();

// True where oneDNN has a native bf16 matmul on `cpu_isa`: AVX512_BF16 or AMX. Elsewhere it
// widens bf16 operands to f32, which costs the conversions and gains nothing.
bool has_native_bf16(const std::string& cpu_isa);

// What "auto" means on `device` ("cpu", "cuda"): bf16 on a GPU's tensor cores; on the CPU bf16
// where has_native_bf16(cpu_isa), else f32.
Precision resolve_auto(const std::string& device, const std::string& cpu_isa);

}  // namespace moetrain
