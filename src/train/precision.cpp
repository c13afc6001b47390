#include "train/precision.h"

#include "core/check.h"
#include "kernels/gemm.h"

namespace moetrain {

Precision parse_precision(const std::string& name) {
  for (Precision p : {Precision::Auto, Precision::F32, Precision::BF16, Precision::FP16,
                      Precision::TF32})
    if (name == precision_name(p)) return p;
  MOETRAIN_FAIL("train.precision = '{}': allowed are auto, f32, bf16, fp16, tf32 (cuda)", name);
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::Auto: return "auto";
    case Precision::F32: return "f32";
    case Precision::BF16: return "bf16";
    case Precision::FP16: return "fp16";
    case Precision::TF32: return "tf32";
  }
  return "?";
}

DType gemm_dtype(Precision p) {
  MOETRAIN_CHECK(p != Precision::Auto,
                 "train.precision = auto has not been resolved (TrainConfig::resolve_precision)");
  return p == Precision::BF16 ? DType::BF16 : p == Precision::FP16 ? DType::F16 : DType::F32;
}

DeviceGemm device_gemm(Precision p) {
  return p == Precision::TF32 ? DeviceGemm::TF32
         : p == Precision::BF16 ? DeviceGemm::BF16
                                : DeviceGemm::F32;
}

std::string onednn_cpu_isa() {
  // gemm_backend_info() is "oneDNN <version>, <isa>".
  const std::string info = gemm_backend_info();
  const auto comma = info.rfind(", ");
  return comma == std::string::npos ? std::string("unknown") : info.substr(comma + 2);
}

bool has_native_bf16(const std::string& cpu_isa) {
  return cpu_isa == "avx512_core_bf16" || cpu_isa.find("amx") != std::string::npos;
}

Precision resolve_auto(const std::string& device, const std::string& cpu_isa) {
  if (device == "cuda") return Precision::BF16;
  return has_native_bf16(cpu_isa) ? Precision::BF16 : Precision::F32;
}

}  // namespace moetrain
