#include "train/precision.h"

#include "kernels/gemm.h"

namespace moetrain {

std::string onednn_cpu_isa() {
  // gemm_backend_info() is "oneDNN <version>, <isa>".
  const std::string info = gemm_backend_info();
  const auto comma = info.rfind(", ");
  return comma == std::string::npos ? std::string("unknown") : info.substr(comma + 2);
}

bool has_native_bf16(const std::string& cpu_isa) {
  return cpu_isa == "avx512_core_bf16" || cpu_isa.find("amx") != std::string::npos;
}

std::string resolve_precision(const std::string& precision, const std::string& cpu_isa) {
  if (precision != "auto") return precision;
  return has_native_bf16(cpu_isa) ? "bf16" : "f32";
}

}  // namespace moetrain
